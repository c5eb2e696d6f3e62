"""One sampling run of reuse across steps (``LayerReuseRun``): per batch layout, what the last two full calls
recorded; a call reuses only an entry complete and made in this run, its prediction the last record moved along the
line through the last two (docs/step-reuse.md)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .agreement import Agreement
from .plans import DEFAULT_EXTRAPOLATE
from .schedules import IntervalSchedule

log = logging.getLogger("tome_patch")

# From this size a DiT's residual keeps the line's slope in 4 bits per value (docs/dit.md, the 4-bit slope).
COMPACT_SLOPE_BYTES = 64 * 2**20


class _Entry:
    """One batch layout's record: the last two full calls' outputs (or the last and a packed slope), the shapes."""

    __slots__ = ("outputs", "shapes", "slope", "step", "span_inputs")

    def __init__(self):
        self.outputs: list[tuple[int, torch.Tensor]] = []  # (step, boundary output), oldest first, at most two
        self.shapes: dict[int, object] = {}
        self.slope: _PackedSlope | None = None  # with one output: the line from the record before it
        self.step = -1  # the run's step of the last record
        # A DiT's span input at the last full calls, (position, input): what the guards weigh a call against.
        self.span_inputs: list[tuple[float, torch.Tensor]] = []

    # Out of compiled graphs: a graph would take the noise levels as constants and compile again at every step.
    @torch.compiler.disable
    def record(self, position: float, output: torch.Tensor, compact: bool = False, keep: int = 2) -> None:
        if self.outputs and self.outputs[-1][0] == position:  # the same step again (another call of this layout)
            self.outputs.pop()
            self.slope = None
        if compact and self.outputs and output.shape[-1] % 2 == 0:
            last_position, last = self.outputs[-1]
            self.slope = _PackedSlope.of(output - last, last_position)
            self.outputs = [(position, output)]
            return
        self.slope = None
        self.outputs = (self.outputs + [(position, output)])[-keep:]

    @torch.compiler.disable
    def predict(self, position: float, extrapolate: float) -> torch.Tensor:
        last_position, last = self.outputs[-1]
        if self.slope is not None:
            if not extrapolate:
                return last
            ahead = (position - last_position) / (last_position - self.slope.position)
            return last + self.slope.unpacked(last.dtype) * (extrapolate * ahead)
        if not extrapolate or len(self.outputs) < 2:
            return last
        first_position, first = self.outputs[-2]
        ahead = (position - last_position) / (last_position - first_position)
        return torch.lerp(first, last, 1.0 + extrapolate * ahead)

    def nbytes(self) -> int:
        held = sum(t.numel() * t.element_size() for _, t in self.outputs)
        return held + (self.slope.nbytes() if self.slope is not None else 0)


class _PackedSlope:
    """The difference of two records in 4 bits per value, a float32 scale per token, the earlier record's position."""

    __slots__ = ("packed", "scale", "position")
    ROWS = 4096  # tokens packed at a time: the float32 working copies stay small beside the cache itself

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, position: float):
        self.packed, self.scale, self.position = packed, scale, position

    @classmethod
    def of(cls, slope: torch.Tensor, position: float) -> _PackedSlope:
        rows = slope.reshape(-1, slope.shape[-1])
        packed = torch.empty(rows.shape[0], rows.shape[1] // 2, dtype=torch.uint8, device=slope.device)
        scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=slope.device)
        for start in range(0, rows.shape[0], cls.ROWS):
            wide = rows[start : start + cls.ROWS].float()
            step = wide.abs().amax(dim=-1, keepdim=True) / 7
            levels = torch.round(wide / step.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-7, 7)
            codes = (levels + 8).to(torch.uint8)  # 1 to 15
            packed[start : start + cls.ROWS] = codes[:, 0::2] | (codes[:, 1::2] << 4)
            scale[start : start + cls.ROWS] = step
        shape = slope.shape[:-1]
        return cls(packed.reshape(*shape, -1), scale.reshape(*shape, 1), position)

    def unpacked(self, dtype: torch.dtype) -> torch.Tensor:
        codes = torch.stack((self.packed & 15, self.packed >> 4), dim=-1).flatten(-2)
        return (codes.to(dtype) - 8) * self.scale.to(dtype)

    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel() * self.scale.element_size()


@dataclass
class _Call:
    """The current model call: its step, whether it reuses, and its batch layout's entry."""

    step: int
    position: float
    reuse: bool
    entry: _Entry
    span_input: torch.Tensor | None = None  # a DiT's full call: the inner span's input (see ``start_span``)


class LayerReuseRun:
    """The cache of one sampling run (see the module docstring); also counts what it did, for the log."""

    KEEP = 2  # the full steps each record holds: the line through the last two

    def __init__(
        self,
        schedule: IntervalSchedule,
        steps: int,
        layers: int,
        extrapolate: float = DEFAULT_EXTRAPOLATE,
        first_block_guard: float | None = None,
        line_guard: float | None = None,
    ):
        self.schedule = schedule
        self.steps = steps
        self.layers = layers  # how many inner layers there are; the last one is the boundary
        self.extrapolate = extrapolate
        # A reusing call runs in full where the span's input moved more than ``first_block_guard`` since the last
        # full call, or lies more than ``line_guard`` off the line through the last two (None: no such guard).
        self.first_block_guard = first_block_guard
        self.line_guard = line_guard
        self.guarded_calls = 0  # reusing calls a guard turned into full ones
        self.entries: dict[object, _Entry] = {}
        self.current: _Call | None = None
        self.last_step = -1
        # A layout that missed the latest full step (cond and uncond split otherwise since) runs in full.
        self.latest_full_step = -1
        self.calls = 0
        self.reused_calls = 0
        # The noise level below which the host runs every call in full (``full_below_noise``; 0: none).
        self.full_below = 0.0
        self.outer_words = "the outer layers (the first input block and the last output block)"
        self.inner_words = "layers' output"
        # Why this run stood down (None: it did not); from then on every call runs in full.
        self.stood_down: str | None = None
        # Under sequence parallelism, the group that decides each DiT call together (set by the host door per call).
        self.agreement: Agreement | None = None
        self._group_stood_down = False

    def drop(self) -> None:
        self.entries.clear()
        self.current = None
        self.latest_full_step = -1

    def begin_call(self, step: int | None, key: object, allowed: bool = True, position: float | None = None) -> bool:
        """A model call at ``step`` (None: off the schedule) for layout ``key``; ``allowed`` False runs it in full,
        ``position`` places it on the prediction's line (default: the step). True when it reuses."""
        self.calls += 1
        if self.stood_down is not None and (self.agreement is None or self._group_stood_down):
            self.current = None
            return False
        if step is None:  # off the schedule: nothing cached may belong to it, and it records nothing
            self.drop()
            return False
        if step < self.last_step:  # going back: not the run the cache was made in; it starts anew here
            self.drop()
        self.last_step = step
        entry = self.entries.setdefault(key, _Entry())
        scheduled = allowed and self.stood_down is None and not self.schedule.is_full(step, self.steps)
        if not scheduled:
            self.latest_full_step = step
        reuse = (
            scheduled
            and len(entry.shapes) == self.layers
            and bool(entry.outputs)
            and entry.step >= self.latest_full_step
        )
        self.current = _Call(step, float(step if position is None else position), reuse, entry)
        self.reused_calls += reuse
        return reuse

    def end_call(self) -> None:
        self.current = None

    def run_layer(self, index: int, forward: Callable, args: tuple, kwargs: dict):
        """Inner layer ``index``: run and record, or stand in (the boundary returns a tensor or a 1-tuple of one)."""
        call = self.current
        if call is None:
            return forward(*args, **kwargs)
        boundary = index == self.layers - 1
        if index == 0 and args and isinstance(args[0], torch.Tensor):
            self._watch_first_input(call, args[0])
        if call.reuse:
            spec = call.entry.shapes[index]
            if not boundary:
                return _zeros_like_spec(spec)
            predicted = self.predict(call.entry, call.position)
            return predicted if isinstance(spec[0], tuple) else spec[0]((predicted,))
        out = forward(*args, **kwargs)
        call.entry.shapes[index] = _spec_of(out)
        if boundary:
            feature = out if isinstance(out, torch.Tensor) else _first_tensor(out)
            if feature is None:  # a boundary without a tensor to predict: this layout never reuses
                call.entry.shapes.pop(index)
            else:
                # A copy: the host may add to its output in place (ControlNet).
                call.entry.record(call.position, feature.detach().clone(), keep=self.KEEP)
                call.entry.step = call.step
        return out

    # A DiT's inner blocks are one *span*: a reusing call adds its predicted residual (output minus input) to its
    # input. The door calls ``start_span`` at its first block, ``end_span`` / ``predicted_span_output`` at its last.

    def start_span(self, joined_input: torch.Tensor | None) -> bool:
        """The span's first block is about to run on ``joined_input`` (None: streams it cannot join); True when the
        call reuses. A reusing call of another token layout runs in full."""
        call = self.current
        if call is None:
            return False
        if call.reuse and (joined_input is None or tuple(joined_input.shape) != call.entry.shapes[0][0]):
            self.compute_in_full()
            call.entry.outputs.clear()
            call.entry.shapes.clear()
        if self.agreement is not None:
            self._agree(call, joined_input)
        elif joined_input is not None:
            self._guard(call, joined_input)
        if not call.reuse and joined_input is not None and self.stood_down is None:
            # A copy: the host may change its tensors in place later in the call (ControlNet residuals).
            call.span_input = joined_input.detach().clone()
            self._keep_span_input(call, call.span_input)
        return call.reuse

    @torch.compiler.disable
    def _agree(self, call: _Call, joined_input: torch.Tensor | None) -> None:
        """The group's verdict: full if any process cannot reuse, stand down if any does, the guards on the totals."""
        sums = None
        if call.reuse and joined_input is not None and self.guarded:
            sums = self._guard_sums(call.entry, joined_input)
        device = joined_input.device if joined_input is not None else None
        flags = torch.tensor([not call.reuse, self.stood_down is not None], dtype=torch.float32, device=device)
        evidence = torch.cat((flags, torch.zeros(4, device=device) if sums is None else sums.to(device)))
        full, down, *totals = self.agreement.totals(evidence)
        if down:
            self._group_stood_down = True
            if self.stood_down is None:
                self.stand_down("another process of its context-parallel group stood down")
        elif full:
            self.compute_in_full()
        elif self._moved(totals):
            self.compute_in_full()
            self.guarded_calls += 1

    def _watch_first_input(self, call: _Call, first_input: torch.Tensor) -> None:
        """A UNet's first inner layer's input: the guards may turn the call full; a full call's input is kept."""
        if not self.guarded:
            return
        self._guard(call, first_input)
        if not call.reuse:
            # A copy: the host may add to it in place later in the call (ControlNet).
            self._keep_span_input(call, first_input.detach().clone())

    @property
    def guarded(self) -> bool:
        return self.first_block_guard is not None or self.line_guard is not None

    def _guard(self, call: _Call, span_input: torch.Tensor) -> None:
        if self.guarded and call.reuse:
            if self._span_input_moved(call.entry, span_input):
                self.compute_in_full()
                self.guarded_calls += 1

    def _keep_span_input(self, call: _Call, span_input: torch.Tensor) -> None:
        """A full call's span input, kept for the guards to weigh the next calls against (two for the line)."""
        if not self.guarded:
            return
        kept = [(x, t) for x, t in call.entry.span_inputs if x != call.position]  # not this step's again
        count = 1 if self.line_guard is None else 2
        call.entry.span_inputs = (kept + [(call.position, span_input)])[-count:]

    def _span_input_moved(self, entry: _Entry, joined_input: torch.Tensor) -> bool:
        """Whether the span's input moved, or left the line, past a guard."""
        sums = self._guard_sums(entry, joined_input)
        return sums is not None and self._moved(sums.tolist())

    def _guard_sums(self, entry: _Entry, joined_input: torch.Tensor) -> torch.Tensor | None:
        """(sum |x - x_full|, sum |x_full|, sum |x - x_line|, sum |x_line|) in float32, x_full and x_line from the
        last full calls' inputs; None where none of this shape is kept."""
        if not entry.span_inputs or entry.span_inputs[-1][1].shape != joined_input.shape:
            return None
        moved = joined_input.detach()
        last_position, last = entry.span_inputs[-1]
        expected = last
        if self.line_guard is not None and len(entry.span_inputs) == 2 and entry.span_inputs[0][1].shape == last.shape:
            first_position, first = entry.span_inputs[0]
            ahead = (self.current.position - last_position) / (last_position - first_position)
            expected = torch.lerp(first, last, 1.0 + ahead)
        pairs = ((moved - last, last), (moved - expected, expected))
        return torch.stack([t.abs().sum(dtype=torch.float32) for pair in pairs for t in pair])

    def _moved(self, sums: list[float]) -> bool:
        moved, last, off_line, line = sums
        if self.first_block_guard is not None and moved / max(last, 1e-12) > self.first_block_guard:
            return True
        return self.line_guard is not None and off_line / max(line, 1e-12) > self.line_guard

    def compute_in_full(self) -> None:
        """The call in progress runs every block after all (asked before anything was skipped)."""
        call = self.current
        if call is not None and call.reuse:
            self.reused_calls -= 1
            call.reuse = False

    def end_span(self, joined_output: torch.Tensor) -> None:
        """A full call's span ended with ``joined_output``: record its residual."""
        call = self.current
        if call is None or call.span_input is None or joined_output.shape != call.span_input.shape:
            return
        residual = joined_output.detach() - call.span_input
        call.span_input = None
        call.entry.shapes[0] = _spec_of(residual)
        compact = residual.numel() * residual.element_size() >= COMPACT_SLOPE_BYTES
        call.entry.record(call.position, residual, compact)
        call.entry.step = call.step

    def predict(self, entry: _Entry, position: float) -> torch.Tensor:
        """What a reusing call at ``position`` stands in with: ``entry``'s record moved along its line."""
        return entry.predict(position, self.extrapolate)

    def predicted_span_output(self, joined_input: torch.Tensor) -> torch.Tensor:
        """A reusing call: the span's output, its input plus the residual predicted from the last full calls."""
        call = self.current
        return joined_input + self.predict(call.entry, call.position).to(joined_input.dtype)

    def span_block(
        self, first: bool, last: bool, streams: dict, run_block: Callable, streams_of: Callable, in_full=None, pack=None
    ):
        """One block of a DiT's span: ``streams`` its inputs by name in token order, ``run_block()`` runs it,
        ``streams_of(out)`` its outputs, ``in_full()`` (first block) True where the call must run every block. Returns
        the block's output or, skipped, the streams passed on (at the last block plus the predicted residual, as
        ``pack(streams)``). A stream it cannot join makes the run stand down."""
        call = self.current
        if call is None:
            return run_block()
        if first:
            if in_full is not None and in_full():
                self.compute_in_full()
            joined = join_streams(streams)
            if joined is None:
                self.stand_down(f"a DiT block handed over {describe_streams(streams)}")
            reuse = self.start_span(joined)
            if self.stood_down is not None:
                return run_block()
        else:
            reuse = call.reuse
        if not reuse:
            out = run_block()
            if last:
                joined = join_streams(streams_of(out))
                if joined is None:
                    self.stand_down(f"a DiT block returned {describe_streams(streams_of(out))}")
                else:
                    self.end_span(joined)
            return out
        passed = streams if not last else split_streams(self.predicted_span_output(join_streams(streams)), streams)
        return passed if pack is None else pack(passed)

    def stand_down(self, why: str) -> None:
        """The call in progress (nothing skipped yet) and every later call of the run run in full; one log line."""
        self.compute_in_full()
        if self.current is not None:
            self.current.span_input = None
        self.entries.clear()
        if self.stood_down is None:
            self.stood_down = why
            log.warning(
                "ToMe reuse across steps stands down for this run: %s, which it cannot predict; every step runs in "
                "full.",
                why,
            )

    def cache_bytes(self) -> int:
        return sum(entry.nbytes() for entry in self.entries.values())

    def summary(self) -> str:
        return (
            f"{self.calls - self.reused_calls} of {self.calls} model calls computed in full; {self.reused_calls} ran "
            f"only {self.outer_words}, with the inner {self.inner_words} predicted from earlier steps"
        )


def stream_parts(streams: dict) -> list[torch.Tensor] | None:
    """The tensors of a block's streams in token order (a stream: a tensor or a tuple of them; None left out); None
    where a stream is anything else or the parts differ in batch."""
    parts = []
    for value in streams.values():
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            parts.append(value)
        elif isinstance(value, (tuple, list)) and value and all(isinstance(t, torch.Tensor) for t in value):
            parts.extend(value)
        else:
            return None
    if not parts or any(p.dim() < 2 or p.shape[0] != parts[0].shape[0] for p in parts):
        return None
    return parts


def describe_streams(streams: dict) -> str:
    return ", ".join(f"{name}: {type(value).__name__}" for name, value in streams.items() if value is not None) or (
        "no stream"
    )


def _tokens_apart(parts: list[torch.Tensor]) -> bool:
    first = parts[0]
    return all(p.dim() == first.dim() and p.shape[2:] == first.shape[2:] for p in parts)


def _row_width(parts: list[torch.Tensor]) -> int:
    """The row width parts of other widths (LTX-2's video and audio) are cut into."""
    return math.gcd(*(int(p.shape[-1]) for p in parts)) or 1


def join_streams(streams: dict) -> torch.Tensor | None:
    """A block's streams as one tensor, tokens after tokens (streams of other widths cut into rows of one); None where
    ``stream_parts`` is."""
    parts = stream_parts(streams)
    if parts is None:
        return None
    if len(parts) == 1:
        return parts[0]
    if _tokens_apart(parts):
        return torch.cat(parts, 1)
    width = _row_width(parts)
    return torch.cat([p.reshape(p.shape[0], p.numel() // (p.shape[0] * width), width) for p in parts], 1)


def split_streams(joined: torch.Tensor, like: dict) -> dict:
    """The inverse of ``join_streams``, with the shapes of ``like``."""
    parts = stream_parts(like)
    if len(parts) == 1:
        pieces = [joined]
    elif _tokens_apart(parts):
        pieces = torch.split(joined, [p.shape[1] for p in parts], 1)
    else:
        width = _row_width(parts)
        rows = [p.numel() // (p.shape[0] * width) for p in parts]
        pieces = [piece.reshape(p.shape) for piece, p in zip(torch.split(joined, rows, 1), parts, strict=True)]
    pieces = iter(pieces)
    out = {}
    for name, value in like.items():
        if value is None or isinstance(value, torch.Tensor):
            out[name] = None if value is None else next(pieces)
        else:
            out[name] = type(value)(next(pieces) for _ in value)
    return out


def _spec_of(out):
    if isinstance(out, torch.Tensor):
        return (tuple(out.shape), out.dtype, out.device)
    if isinstance(out, (tuple, list)):
        return (type(out), [_spec_of(item) for item in out])
    return ("value", out)


def _first_tensor(out):
    """The feature of a boundary that returns a one-item tuple (diffusers' ``return_dict=False``), else None."""
    if isinstance(out, tuple) and len(out) == 1 and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _zeros_like_spec(spec):
    if isinstance(spec[0], tuple):
        shape, dtype, device = spec
        return torch.zeros(shape, dtype=dtype, device=device)
    if spec[0] == "value":
        return spec[1]
    kind, items = spec
    return kind(_zeros_like_spec(item) for item in items)
