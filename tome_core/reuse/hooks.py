"""The skippable forwards every host door shares: each inner layer gets a ``SkippableLayer`` forward; at a reusing
call the layers before the *boundary* return zeros of their recorded shapes, the boundary the predicted feature."""

from __future__ import annotations

from collections.abc import Callable

from .cache import LayerReuseRun
from .plans import DEFAULT_EXTRAPOLATE
from .schedules import IntervalSchedule


class LayerReuse:
    """Owns one patch's forwards, makes each sampling run's ``LayerReuseRun`` and holds the call's (``layer_run``)."""

    RUN_WORDS: tuple[str, str] | None = None
    run_class = LayerReuseRun  # what ``new_run`` makes

    def __init__(self, schedule: IntervalSchedule, layers: int, extrapolate: float = DEFAULT_EXTRAPOLATE):
        self.schedule = schedule
        self.layers = layers
        self.extrapolate = extrapolate
        self.plan = "auto"
        self._current: LayerReuseRun | None = None

    def __deepcopy__(self, memo):
        return self  # shared by every copy of the model options that hold it, like a function

    def layer_run(self) -> LayerReuseRun | None:
        return self._current

    def new_run(self, steps: int, noise_levels=None, full_below: float = 0.0, schedule=None) -> LayerReuseRun:
        """A run on this patch's schedule, or on ``schedule`` (a calibration's candidate or kept plan)."""
        source = self.schedule if schedule is None else schedule
        planned = source.for_run(steps, noise_levels, full_below)
        reach = getattr(planned, "extrapolate", None)
        run = self.run_class(
            planned,
            steps,
            self.layers,
            self.extrapolate if reach is None else reach,
            first_block_guard=getattr(source, "first_block_guard", None),
            line_guard=getattr(source, "line_guard", None),
        )
        run.full_below = full_below
        if self.RUN_WORDS is not None:
            run.outer_words, run.inner_words = self.RUN_WORDS
        return run

    def begin_call(self, run: LayerReuseRun, step: int | None, key: object, allowed=True, position=None) -> bool:
        reuse = run.begin_call(step, key, allowed=allowed, position=position)
        self._current = run
        return reuse

    def end_call(self, failed: bool = False) -> LayerReuseRun | None:
        """The call is over (``failed``: it raised, and the run's cache goes); returns its run or None."""
        run, self._current = self._current, None
        if run is not None:
            run.end_call()
            if failed:
                run.drop()
        return run


def attach_forwards(owner, layers, forward_class=None) -> None:
    """Give every inner layer a ``forward_class`` forward of ``owner``, replacing one a clone left there."""
    forward_class = forward_class or SkippableLayer
    for index, layer in enumerate(layers):
        current = layer.__dict__.get("forward")
        if isinstance(current, SkippableLayer):
            current = current.inner
        layer.__dict__["forward"] = forward_class(owner, index, layer, current)


def detach_forwards(modules, owned: Callable[[object], bool]) -> None:
    """Remove the forwards whose owner ``owned`` accepts, putting back what was there before."""
    for module in modules:
        current = module.__dict__.get("forward")
        if isinstance(current, SkippableLayer) and owned(current.owner):
            if current.inner is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = current.inner


class SkippableLayer:
    """The instance ``forward`` of one inner layer while reuse is on."""

    def __init__(self, owner, index: int, layer, inner=None):
        self.owner = owner
        self.index = index
        self.layer = layer
        self.inner = inner  # an instance forward that was there before ours (None: the class's)

    def __deepcopy__(self, memo):
        return self

    def original(self, *args, **kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.layer).forward(self.layer, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        run = self.owner.layer_run()
        if run is None:
            return self.original(*args, **kwargs)
        return run.run_layer(self.index, self.original, args, kwargs)
