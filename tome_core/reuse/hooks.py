"""The forwards that let a host's layers be skipped: the hooks' base that every host door shares.

An adapter lists the inner layers in the order a call runs them (the last one is the *boundary*, whose output the
outer layers read) and gives each a ``SkippableLayer`` as its forward; the host's loop and skip connections stay as
they are. At a reusing step every inner layer but the boundary returns zeros of the shape it returned at the last
full step (its output only feeds other inner layers), and the boundary returns the predicted feature.

``LayerReuse`` owns those forwards (``attach_forwards`` / ``detach_forwards``), makes each run and knows the call in
progress. A host door says only what differs: when a run starts and ends, and which step, batch layout and noise
level each model call is.
"""

from __future__ import annotations

from collections.abc import Callable

from .cache import LayerReuseRun
from .plans import DEFAULT_EXTRAPOLATE
from .schedules import IntervalSchedule


class LayerReuse:
    """The owner of one patch's ``SkippableLayer`` forwards: makes each sampling run's ``LayerReuseRun`` and holds
    the run of the model call in progress (``layer_run``), which the forwards ask for. Hosts subclass it with
    their way of finding runs and steps, or hold one."""

    # What the run's log line calls the layers that always run and the prediction (None: a UNet's words).
    RUN_WORDS: tuple[str, str] | None = None
    run_class = LayerReuseRun  # what ``new_run`` makes

    def __init__(self, schedule: IntervalSchedule, layers: int, extrapolate: float = DEFAULT_EXTRAPOLATE):
        self.schedule = schedule
        self.layers = layers  # how many inner layers there are; the last one is the boundary
        self.extrapolate = extrapolate
        # The UNet's ``reuse_plan``: which samplers it runs with (``samplers.keeps_the_picture_with``).
        self.plan = "auto"
        self._current: LayerReuseRun | None = None

    def __deepcopy__(self, memo):
        return self  # shared by every copy of the model options that hold it, like a function

    def layer_run(self) -> LayerReuseRun | None:
        return self._current

    def new_run(self, steps: int, noise_levels=None, full_below: float = 0.0) -> LayerReuseRun:
        """A run of ``steps`` at ``noise_levels`` (one per step; what a DiT's schedule spaces its full steps by),
        whose calls below ``full_below`` run in full (``full_below_noise``)."""
        schedule = self.schedule.for_run(steps, noise_levels, full_below)
        reach = getattr(schedule, "extrapolate", None)  # a schedule's own reach (a UNet family's plan)
        run = self.run_class(
            schedule,
            steps,
            self.layers,
            self.extrapolate if reach is None else reach,
            # A DiT family's default carries its guards in its schedule (``StepCountSchedule``).
            first_block_guard=getattr(self.schedule, "first_block_guard", None),
            line_guard=getattr(self.schedule, "line_guard", None),
        )
        run.full_below = full_below
        if self.RUN_WORDS is not None:
            run.outer_words, run.inner_words = self.RUN_WORDS
        return run

    def begin_call(self, run: LayerReuseRun, step: int | None, key: object, allowed=True, position=None) -> bool:
        """A model call of ``run`` starts (see ``LayerReuseRun.begin_call``); the layers follow it until
        ``end_call``. Returns True when it reuses."""
        reuse = run.begin_call(step, key, allowed=allowed, position=position)
        self._current = run
        return reuse

    def end_call(self, failed: bool = False) -> LayerReuseRun | None:
        """The model call is over; ``failed``: it raised, so what it recorded may be half-made and the run's cache
        goes (the next calls run in full). Returns the call's run (None if no call was in progress)."""
        run, self._current = self._current, None
        if run is not None:
            run.end_call()
            if failed:
                run.drop()
        return run


def attach_forwards(owner, layers, forward_class=None) -> None:
    """Give every inner layer (in call order) a ``SkippableLayer`` (or ``forward_class``, a subclass) of ``owner``
    as its instance ``forward``. One left by another owner that was never detached (a clone's) is replaced,
    keeping what was there before it."""
    forward_class = forward_class or SkippableLayer
    for index, layer in enumerate(layers):
        current = layer.__dict__.get("forward")
        if isinstance(current, SkippableLayer):
            current = current.inner
        layer.__dict__["forward"] = forward_class(owner, index, layer, current)


def detach_forwards(modules, owned: Callable[[object], bool]) -> None:
    """Remove every ``SkippableLayer`` forward whose owner ``owned(owner)`` accepts from ``modules``, putting back
    what was there before it; the layers then compute exactly as before."""
    for module in modules:
        current = module.__dict__.get("forward")
        if isinstance(current, SkippableLayer) and owned(current.owner):
            if current.inner is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = current.inner


class SkippableLayer:
    """The ``forward`` of one inner layer while layer reuse is on (an instance attribute of the layer).

    ``owner.layer_run()`` gives the run of the current call, or None outside a sampling run."""

    def __init__(self, owner, index: int, layer, inner=None):
        self.owner = owner
        self.index = index
        self.layer = layer
        self.inner = inner  # an instance-level forward that was there before ours (None: the class's)

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
