"""ComfyUI: run a sampling run with an object of ours (reuse's per-run cache) in a copy of the guider's transformer
options, through an OUTER_SAMPLE wrapper, and drop it after, however the run ends."""

from __future__ import annotations

import logging
from contextlib import contextmanager

log = logging.getLogger("tome_patch")


@contextmanager
def run_options(guider, values: dict):
    """The guider's transformer options with ``values`` for the run inside (a copy), as they were after it."""
    original = guider.model_options
    options = dict(original)
    options["transformer_options"] = {**original.get("transformer_options", {}), **values}
    guider.model_options = options
    try:
        yield
    finally:
        guider.model_options = original


def sample_with_run(executor, args, kwargs, key: str, value, run, on_end) -> object:
    """Run ``executor`` with ``value`` at ``transformer_options[key]``; then drop ``run``'s cache, call ``on_end``."""
    try:
        with run_options(executor.class_obj, {key: value}):
            return executor(*args, **kwargs)
    finally:
        run.drop()
        on_end(run)
        log.info("ToMe reuse across steps: %s", run.summary())
