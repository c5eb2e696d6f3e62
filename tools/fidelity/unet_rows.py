"""This project's reuse across steps on the UNets, through its node: the node's rows, and with ``variants`` the
plan a job saved before ``reuse_plan`` existed runs."""

from __future__ import annotations

from tools.fidelity.peer_rows import followed_by_easycache
from tools.fidelity.row import FidelityRow, ours


def layer_reuse_rows(nodes: dict, variants: bool) -> list[FidelityRow]:
    """Setting reuse_interval alone (ToDo off) and with ToDo 2, the plans of saved jobs, and ToDo under EasyCache."""
    rows = []
    for interval in (2, 3, 4):
        rows.append(
            ours(nodes, f"ours reuse every {interval}", method="todo", downsample_factor=1.0, reuse_interval=interval)
        )
    for interval in (2, 3):
        rows.append(ours(nodes, f"ours ToDo 2 + reuse every {interval}", method="todo", reuse_interval=interval))
    # The default before "forecast" (what a job saved with reuse_plan "auto" runs), with ToDo 2 and alone.
    rows.append(ours(nodes, "ours ToDo 2 + reuse every 3 plan auto", method="todo", reuse_interval=3,
                     reuse_plan="auto"))  # fmt: skip
    rows.append(ours(nodes, "ours reuse every 3 plan auto", method="todo", downsample_factor=1.0, reuse_interval=3,
                     reuse_plan="auto"))  # fmt: skip
    # The forecast before "forecast v2" (DPM++ 2M on Karras sigmas: 19 of 25 computed), what a job saved with it runs.
    rows.append(ours(nodes, "ours reuse every 3 plan forecast", method="todo", downsample_factor=1.0, reuse_interval=3,
                     reuse_plan="forecast"))  # fmt: skip
    # Space and time: ToDo in every call EasyCache computes (layer reuse stands down under a step cache).
    rows.append(followed_by_easycache(ours(nodes, "ours ToDo 2", method="todo")))
    if variants:  # the plan before the family plans (what a job saved before ``reuse_plan`` existed runs)
        name = "ours ToDo 2 + reuse every 3 plan every N"
        rows.append(ours(nodes, name, method="todo", reuse_interval=3, reuse_plan="every N"))
    return rows
