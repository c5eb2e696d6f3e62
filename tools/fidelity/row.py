"""What a fidelity row is, and this project's rows through its ComfyUI node."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tome_core.settings import SPECS

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class FidelityRow:
    """One way of sampling: ``patch(model)`` returns the ModelPatcher to sample with."""

    name: str
    group: str  # "unpatched", "ours", "peer" or "broken"
    patch: Callable
    enter: Callable[[], None] = lambda: None
    leave: Callable[[], None] = lambda: None
    settings: dict = field(default_factory=dict)
    # Work done before the row is sampled, neither timed nor counted (MagCache's calibration run).
    prepare: Callable = lambda patcher: None


def node_patch(node_cls, **inputs) -> Callable:
    """This project's patch applied by running the ComfyUI node class, as a graph would."""

    def patch(model):
        if hasattr(node_cls, "GET_SCHEMA"):  # V3 node
            return node_cls.execute(model=model, **inputs).result[0]
        return getattr(node_cls(), node_cls.FUNCTION)(model=model, **inputs)[0]

    return patch


def load_our_nodes() -> dict:
    """Load this repository with ComfyUI's custom node loader; returns its node classes by id."""
    import asyncio

    import nodes as comfy_nodes

    if "ToMePatchAdvanced" not in comfy_nodes.NODE_CLASS_MAPPINGS:
        if not asyncio.run(comfy_nodes.load_custom_node(str(ROOT), module_parent="custom_nodes")):
            raise RuntimeError("ComfyUI did not load this repository as a custom node package")
    return comfy_nodes.NODE_CLASS_MAPPINGS


def ours(nodes: dict, name: str, **values) -> FidelityRow:
    # reuse_plan as a node added anew has it (a prompt that leaves it out means the plan before it existed).
    inputs = {"max_downsample": "auto", "skip_when_slower": False, "reuse_plan": SPECS["reuse_plan"].default, **values}
    inputs["max_downsample"] = str(inputs["max_downsample"])
    return FidelityRow(name, "ours", node_patch(nodes["ToMePatchAdvanced"], **inputs), settings=inputs)
