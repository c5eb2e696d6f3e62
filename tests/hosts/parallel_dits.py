"""The tiny diffusers DiTs (``diffusers_dit_host``) under diffusers' context parallelism, in processes of a gloo
group on the CPU: ``spawn`` starts one process per rank, each runs the named scenarios in order and saves what
they return; rank 0 also runs each scenario's single-process reference.

Ulysses runs as diffusers has it. Ring attention needs the attention's log-sum-exp, which diffusers' CPU backend
(``native``) does not return: ``ring_on_cpu`` gives that backend a plain attention that does, for the test only.
"""

from __future__ import annotations

import datetime
import logging
import time
import traceback
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 20  # under 10 steps every step runs in full
GROUP_TIMEOUT_S = 20  # the group's timeout: what a process waits for a failed peer at most


def spawn(world: int, scenarios: list[tuple[str, dict]], folder: Path, deadline_s: float = 240) -> list[dict]:
    """Run ``scenarios`` in ``world`` processes; returns what each rank saved (its ``"error"``, where it raised).
    Processes still alive at the deadline are killed."""
    context = torch.multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_worker, args=(rank, world, str(folder), scenarios), daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    end = time.monotonic() + deadline_s
    for process in processes:
        process.join(max(0.0, end - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(10)
    results = []
    for rank in range(world):
        path = folder / f"rank{rank}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else {"error": "no result (killed)"})
    return results


def _worker(rank: int, world: int, folder: str, scenarios: list[tuple[str, dict]]) -> None:
    torch.set_num_threads(1)
    results: dict = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{folder}/store",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
        )
        from tome_core.reuse.agreement import several_processes

        results["several_processes"] = several_processes()
        logging.getLogger("tome_patch").setLevel(logging.INFO)
        for name, options in scenarios:
            started, said = time.monotonic(), _Said()
            logging.getLogger("tome_patch").addHandler(said)
            try:
                results[name] = SCENARIOS[options.get("scenario", name)](rank, **options)
            finally:
                logging.getLogger("tome_patch").removeHandler(said)
            results[name].update(seconds=time.monotonic() - started, log=said.lines)
    except BaseException as error:  # noqa: BLE001 - the parent reads it
        results["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    finally:
        torch.save(results, Path(folder) / f"rank{rank}.pt")
        if dist.is_initialized():
            dist.destroy_process_group()


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


# --- what a scenario runs ------------------------------------------------------------------------------------------


def _pipeline(family: str):
    from hosts import diffusers_dit_host as D

    return {"wan": D.wan_pipeline, "flux": D.flux_pipeline}.get(family) or D.FAMILY_MAKERS[family]


def _generate(pipe, family: str) -> torch.Tensor:
    from hosts import diffusers_dit_host as D

    return D.run(pipe, steps=STEPS) if family in ("wan", "flux") else D.family_run(pipe, steps=STEPS)


def _parallel(pipe, mode: str) -> None:
    from diffusers import ContextParallelConfig

    world = dist.get_world_size()
    config = (
        ContextParallelConfig(ulysses_degree=world) if mode == "ulysses" else ContextParallelConfig(ring_degree=world)
    )
    pipe.transformer.enable_parallelism(config=config)


@contextmanager
def ring_on_cpu():
    """diffusers' ``native`` backend with an attention that returns the log-sum-exp (``lse_attention``)."""
    from diffusers.models import attention_dispatch

    from tools.fidelity.diffusers.parallel import lse_attention

    original = attention_dispatch._native_attention_forward_op
    attention_dispatch._native_attention_forward_op = lse_attention
    try:
        yield
    finally:
        attention_dispatch._native_attention_forward_op = original


class Watch:
    """Every reuse run's decision per call (did the call reuse), and each vote's evidence and totals."""

    def __init__(self):
        from tome_core.reuse import LayerReuseRun
        from tome_core.reuse.agreement import Agreement

        self.decisions: list[bool] = []
        self.votes: list[tuple[list[float], list[float]]] = []
        self.runs: list = []
        self.recorded: set[tuple[int, ...]] = set()  # the shapes of the residuals the runs recorded
        self._undo = []
        watch = self

        def start_span(run, joined):
            decided = start(run, joined)
            watch.decisions.append(decided)
            if run not in watch.runs:
                watch.runs.append(run)
            return decided

        def totals(agreement, evidence):
            summed = vote(agreement, evidence)
            watch.votes.append((evidence.tolist(), summed))
            return summed

        def end_span(run, joined):
            watch.recorded.add(tuple(joined.shape))
            return end(run, joined)

        start, vote, end = LayerReuseRun.start_span, Agreement.totals, LayerReuseRun.end_span
        patches = ((LayerReuseRun, "start_span", start_span), (Agreement, "totals", totals))
        for owner, name, value in (*patches, (LayerReuseRun, "end_span", end_span)):
            self._undo.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    def close(self) -> dict:
        for owner, name, value in self._undo:
            setattr(owner, name, value)
        return {
            "decisions": self.decisions,
            "computed": sum(1 for d in self.decisions if not d),
            "guarded": sum(run.guarded_calls for run in self.runs),
            "votes": self.votes,
            "recorded": sorted(self.recorded),
        }


def leftovers(transformer) -> list[str]:
    """What a patch left on ``transformer``: our attributes, forwards and processors, also inside diffusers' hooks."""
    from tome_core.reuse import SkippableLayer

    found = []
    for name, module in transformer.named_modules():
        found += [f"{name}.{key}" for key in module.__dict__ if key.startswith("_tome_patch")]
        if isinstance(module.__dict__.get("forward"), SkippableLayer):
            found.append(f"{name}.forward")
        if "Todo" in type(getattr(module, "processor", None)).__name__:
            found.append(f"{name}.processor")
        registry = module.__dict__.get("_diffusers_hook")
        for ref in getattr(registry, "_fn_refs", ()):
            if isinstance(ref.forward, SkippableLayer) or isinstance(ref.original_forward, SkippableLayer):
                found.append(f"{name} (in diffusers' hooks)")
    return found


def patched(rank, family="wan", mode="ulysses", order="after", settings=None, alone=True, **_) -> dict:
    """Unpatched, patched (``apply_patch`` before or after ``enable_parallelism``) and after ``remove_patch``,
    on one parallel pipeline; on rank 0 also the patched single-process run (``alone``)."""
    import tome_core

    settings = settings or {}
    out: dict = {}
    with ring_on_cpu() if mode == "ring" else _nothing():
        pipe = _pipeline(family)()
        if order == "before":
            tome_core.apply_patch(pipe, **settings)
            _parallel(pipe, mode)
        else:
            _parallel(pipe, mode)
            out["plain"] = _generate(pipe, family)
            tome_core.apply_patch(pipe, **settings)
        watch = Watch()
        try:
            out["patched"] = _generate(pipe, family)
        finally:
            out.update(watch.close())
        tome_core.remove_patch(pipe)
        out["leftovers"] = leftovers(pipe.transformer)
        out["removed"] = _generate(pipe, family)
    if rank == 0 and alone:
        out["single"] = single(family, settings)
    return out


@contextmanager
def _nothing():
    yield


def single(family: str, settings: dict, guard: float | None = None) -> dict:
    """The patched run in this process alone (no parallelism), with its decisions."""
    import tome_core
    from tome_core.hosts.diffusers import dit_reuse

    pipe = _pipeline(family)()
    tome_core.apply_patch(pipe, **settings)
    if guard is not None:
        _set_guard(dit_reuse.installed(pipe.transformer), guard)
    watch = Watch()
    try:
        return {"patched": _generate(pipe, family), **watch.close()}
    finally:
        tome_core.remove_patch(pipe)


def _set_guard(owner, first_block_guard: float) -> None:
    owner.schedule = replace(owner.schedule, first_block_guard=first_block_guard, line_guard=None)


def guard_apart(rank: int, family: str = "wan", mode: str = "ulysses", **_) -> dict:
    """A first-block guard whose threshold lies between what the two shards say at the first guarded call: rank
    0's tokens alone would decide one way, rank 1's the other, the group's totals (as the single process) a third
    time the same as one of them. Found by a probe run whose guard never fires."""
    import tome_core
    from tome_core.hosts.diffusers import dit_reuse

    with ring_on_cpu() if mode == "ring" else _nothing():
        pipe = _pipeline(family)()
        _parallel(pipe, mode)
        tome_core.apply_patch(pipe)
        owner = dit_reuse.installed(pipe.transformer)
        _set_guard(owner, 1e9)
        watch = Watch()
        _generate(pipe, family)
        probe = watch.close()
        # The first vote with the guard's evidence: every call before it ran in full or was not guarded.
        evidence, totals = next((e, t) for e, t in probe["votes"] if e[3] > 0)
        mine = evidence[2] / evidence[3]
        ratios = [None] * dist.get_world_size()
        dist.all_gather_object(ratios, mine)
        whole = totals[2] / totals[3]
        threshold = (whole + max(ratios)) / 2  # above the group's and one shard's, below the other shard's
        _set_guard(owner, threshold)
        watch = Watch()
        try:
            out = {"patched": _generate(pipe, family)}
        finally:
            out.update(watch.close())
        tome_core.remove_patch(pipe)
    out.update(ratios=ratios, whole=whole, threshold=threshold)
    if rank == 0:
        out["single"] = single(family, {}, guard=threshold)
    return out


def failing(rank: int, family: str = "wan", mode: str = "ulysses", call: int = 6, **_) -> dict:
    """Rank 1 raises in its first block's feed-forward at the ``call``-th transformer call; the others reach the
    span's vote and wait there. Returns how each ended and when."""
    import tome_core

    pipe = _pipeline(family)()
    _parallel(pipe, mode)
    tome_core.apply_patch(pipe)
    if rank == 1:
        calls = []
        feed_forward = pipe.transformer.blocks[0].ffn
        original = feed_forward.forward

        def broken(*args, **kwargs):
            calls.append(1)
            if len(calls) == call:
                raise RuntimeError("a failure of rank 1's own")
            return original(*args, **kwargs)

        feed_forward.forward = broken
    started = time.monotonic()
    try:
        _generate(pipe, family)
        ended = "finished"
    except Exception as error:  # noqa: BLE001 - what the test checks
        ended = f"{type(error).__name__}: {error}"
    return {"ended": ended, "waited": time.monotonic() - started}


SCENARIOS = {"patched": patched, "guard": guard_apart, "failing": failing}
