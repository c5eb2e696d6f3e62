"""A variant of reuse across steps (measured, not shipped): the inner layers' output at a reusing step forecast
from more of the run's full steps than the last two, as Spectrum forecasts a whole step (``spectrum``): a ridge
fit of Chebyshev polynomials over the last ``keep`` full steps' records, blended with the engine's own line.

Installed for a row with ``enter`` / ``leave`` on every loaded copy of the engine's cache (ComfyUI loads the node
package under its folder's name): each batch layout's record keeps ``history`` outputs instead of two, and its
prediction, where it has three or more, is ``(1 - blend) * line + blend * fit``, the fit over the records'
positions (their noise levels) mapped to [-1, 1] over the kept records and the step forecast (Spectrum maps the
step over the whole run; the engine's records know their noise level, not the run's length).
"""

from __future__ import annotations

import sys

import torch


def _modules():
    return [module for name, module in sys.modules.items() if name.endswith("tome_core.reuse.cache")]


def _chebyshev(taus: torch.Tensor, degree: int) -> torch.Tensor:
    columns = [torch.ones_like(taus), taus]
    while len(columns) <= degree:
        columns.append(2 * taus * columns[-1] - columns[-2])
    return torch.stack(columns[: degree + 1], dim=1)


def forecast_hooks(blend: float = 0.25, degree: int = 6, ridge: float = 0.5, history: int = 8):
    """``enter`` / ``leave`` for a fidelity row: the forecast above on every engine copy while the row samples;
    Spectrum's own settings by default (blend 0.25, degree 6, ridge 0.5, 8 records)."""
    kept: list = []

    def predict_with_fit(original):
        def predict(self, position, extrapolate):
            line = original(self, position, extrapolate)
            if len(self.outputs) < 3 or self.slope is not None:
                return line
            positions = torch.tensor([p for p, _ in self.outputs] + [position], dtype=torch.float64)
            low, high = float(positions.min()), float(positions.max())
            taus = (2 * (positions - low) / max(high - low, 1e-12) - 1).float()
            history = torch.stack([out.flatten().float() for _, out in self.outputs])
            design = _chebyshev(taus[:-1], min(degree, len(self.outputs) - 1))
            gram = design.T @ design + ridge * torch.eye(design.shape[1])
            coefficients = torch.linalg.solve(gram, design.T @ history)
            fit = (_chebyshev(taus[-1:], design.shape[1] - 1) @ coefficients)[0]
            return torch.lerp(line.float(), fit.view(line.shape), blend).to(line.dtype)

        return predict

    def record_more(original):
        def record(self, position, output, compact=False, keep=2):
            return original(self, position, output, False, max(keep, history))

        return record

    def enter():
        for module in _modules():
            entry = module._Entry
            kept.append((entry, entry.predict, entry.record))
            entry.predict = predict_with_fit(entry.predict)
            entry.record = record_more(entry.record)

    def leave():
        while kept:
            entry, predict, record = kept.pop()
            entry.predict, entry.record = predict, record

    return enter, leave
