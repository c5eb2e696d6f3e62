"""ComfyUI: run a sampling run with an object of ours (reuse's per-run cache) in a copy of the guider's transformer
options, through an OUTER_SAMPLE wrapper, and drop it after, however the run ends."""

from __future__ import annotations

import logging

log = logging.getLogger("tome_patch")


def sample_with_run(executor, args, kwargs, key: str, value, run, on_end) -> object:
    """Run ``executor`` with ``value`` at ``transformer_options[key]``; then drop ``run``'s cache, call ``on_end``."""
    guider = executor.class_obj
    original = guider.model_options
    options = dict(original)
    options["transformer_options"] = {**original.get("transformer_options", {}), key: value}
    guider.model_options = options
    try:
        return executor(*args, **kwargs)
    finally:
        guider.model_options = original
        run.drop()
        on_end(run)
        log.info("ToMe reuse across steps: %s", run.summary())
