"""ComfyUI: run a sampling run with an object of ours in its transformer options, and drop it after, always.

Reuse across steps (``layer_reuse``) keeps its cache in one object per sampling run. An OUTER_SAMPLE wrapper
(comfy/patcher_extension.py ``WrappersMP.OUTER_SAMPLE``, where ComfyUI's EasyCache keeps its state too) puts it
into a copy of the guider's model options for that run only; the guider gets its own options back when the run
ends, however it ends, and the cache is dropped then.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tome_patch")


def sample_with_run(executor, args, kwargs, key: str, value, run, on_end) -> object:
    """Run ``executor`` (the OUTER_SAMPLE chain) with ``value`` at ``transformer_options[key]``; afterwards drop
    ``run``'s cache, call ``on_end(run)`` and log its summary."""
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
