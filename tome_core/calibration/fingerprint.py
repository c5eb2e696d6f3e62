"""A calibration's key: the model by its content (a fixed sample of every tensor, never a name), the weight patches
with their strengths, and the job's sampler, noise levels, CFG and latent shape. docs/calibration.md, 'The key'."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable

import torch

from .search import SEARCH

SAMPLE = 1024  # values read from each tensor, evenly strided
MAX_DEPTH = 6


class UnreadableModelError(TypeError):
    """A tensor or patch whose values cannot be read: its model is not keyed (it would collide with another)."""


def _sample(tensor: torch.Tensor) -> bytes:
    try:
        flat = tensor.detach().reshape(-1)
        stride = max(flat.numel() // SAMPLE, 1)
        values = flat[::stride][:SAMPLE].to("cpu", torch.float32)
    except (RuntimeError, TypeError, NotImplementedError) as err:
        raise UnreadableModelError(f"a {type(tensor).__name__} of shape {tuple(tensor.shape)}: {err}") from err
    return f"{tuple(tensor.shape)}{tensor.dtype}".encode() + values.numpy().tobytes()


def tensors_fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A digest of ``named`` tensors' names, shapes, dtypes and a strided sample of their values."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(_sample(tensor))
    return digest.hexdigest()[:32]


def _walk(value, digest, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise UnreadableModelError("a weight patch nested too deep to read")
    if isinstance(value, torch.Tensor):
        digest.update(_sample(value))
    elif value is None or isinstance(value, bool | int | float | str):
        digest.update(repr(value).encode())
    elif isinstance(value, tuple | list):
        digest.update(f"[{len(value)}".encode())
        for item in value:
            _walk(item, digest, depth + 1)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            digest.update(str(key).encode())
            _walk(value[key], digest, depth + 1)
    elif hasattr(value, "__dict__"):  # an adapter object (a LoRA's): its type and its fields
        digest.update(type(value).__qualname__.encode())
        _walk({k: v for k, v in vars(value).items() if not callable(v)}, digest, depth + 1)
    else:
        raise UnreadableModelError(f"a weight patch of type {type(value).__name__}")


def patches_fingerprint(patches: dict) -> str:
    """A digest of weight patches (key -> list of patch entries: strengths, tensors, adapter objects)."""
    digest = hashlib.sha256()
    _walk(patches, digest)
    return digest.hexdigest()[:32]


def settings_words(settings) -> str:
    """The patch's other settings (ToDo's or ToMe's, the step range, ...) for a key's ``extra``: another is another
    plan. ``settings``: a ``PatchSettings``."""
    values = {k: v for k, v in dataclasses.asdict(settings).items() if k not in ("reuse_plan", "calibration_target")}
    return "settings:" + hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]


def calibration_key(model: str, patches: str, sampler: str | None, sigmas, cfg: float | None, shape,
                    version: str, extra: Iterable[str] = (), steps: int | None = None) -> dict:  # fmt: skip
    """The fields a kept plan is looked up by: another model, patch strength, step count, denoise (the noise levels),
    CFG or latent shape is another key. ``steps``: the step count where the noise levels are not known (empty)."""
    levels = [float(f"{float(level):.5g}") for level in sigmas]
    return {
        "model": model,
        "patches": patches,
        "sampler": sampler,
        "sigmas": levels,
        "steps": steps,
        "cfg": None if cfg is None else round(float(cfg), 4),
        "shape": [int(size) for size in shape],
        "version": version,
        "search": SEARCH,
        "extra": sorted(extra),
    }


def key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def kin_id(key: dict) -> str:
    """The same job at another step count: the key without its noise levels and step count, with the levels' shape (the
    first level and the one half way, which another count of the same schedule and denoise shares)."""
    levels = [level for level in key.get("sigmas") or () if level > 0]
    shape = [] if not levels else [levels[0], _halfway(levels)]
    same = {name: value for name, value in key.items() if name not in ("sigmas", "steps")}
    kin = {**same, "levels": [f"{v:.2g}" for v in shape]}
    return key_id(kin)


def _halfway(levels: list[float]) -> float:
    position = (len(levels) - 1) / 2
    low = int(position)
    high = min(low + 1, len(levels) - 1)
    return levels[low] + (levels[high] - levels[low]) * (position - low)
