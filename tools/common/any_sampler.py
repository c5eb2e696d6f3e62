"""For measuring only: let layer reuse run with a sampler no plan knows yet, on any schedule."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

UNMEASURED = "unmeasured"  # the kind the sampler takes while it is measured


@contextlib.contextmanager
def reuse_with_any_sampler(sampler: str) -> Iterator[None]:
    """In every loaded copy of the engine (ComfyUI loads the node package under its folder's name), ``sampler`` (a
    host's name) gets layer reuse under every plan, on Karras sigmas too; all is put back after."""
    undo = []
    for name, plans in list(sys.modules.items()):
        if not name.endswith("tome_core.reuse.plans"):
            continue
        kinds = sys.modules[name.rsplit(".", 1)[0] + ".samplers"].SAMPLER_KINDS
        key = sampler.strip().lower()
        undo.append((kinds, key, kinds.get(key)))
        kinds[key] = UNMEASURED
        for plan in (*plans.REUSE_PLANS.values(), plans.DIT_PLAN):
            for karras in (False, True):
                plan.rules[(UNMEASURED, karras)] = plans.Rule(plans.LAYERS)
                undo.append((plan.rules, (UNMEASURED, karras), None))
    try:
        yield
    finally:
        for table, key, before in reversed(undo):
            if before is None:
                table.pop(key, None)
            else:
                table[key] = before
