"""Under sequence parallelism every process decides each call from the same totals: one all-reduce (docs/diffusers.md,
on several GPUs)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def several_processes() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Agreement:
    def __init__(self, group, device: torch.device | None = None):
        self.group = group
        self.device = device

    def totals(self, evidence: torch.Tensor) -> list[float]:
        """``evidence`` summed over the group; every process must call this at the same point."""
        summed = evidence.to(self.device or evidence.device, torch.float32)
        try:
            dist.all_reduce(summed, group=self.group)
        except RuntimeError as error:
            rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
            raise RuntimeError(
                f"ToMe reuse across steps: process {rank} of {size} of the context-parallel group did not get the "
                f"other processes' decision for this step (one of them failed, or the group's timeout passed): "
                f"{error}"
            ) from error
        return summed.tolist()
