"""The variants the reuse defaults were chosen from: each a changed engine default, measured with the fidelity
benchmark's ``--variants`` and kept so that the docs' tables can be made again (docs/step-reuse.md, docs/dit.md).

Each entry is ``(interval, changes)``: ``unet_rows.layer_reuse_variant`` (UNets) and ``dit_rows.dit_reuse_variant``
(DiTs) say what each change means."""

from __future__ import annotations

# UNets: the schedule (its start and end, by the noise), the prediction (the line and its reach), the outer blocks.
UNET_VARIANTS = (
    (3, {"extrapolate": 0.0}),
    (3, {"extrapolate": 1.0}),
    (3, {"by_sigma": False}),
    (3, {"by_sigma": False, "extrapolate": 1.0}),
    (3, {"outer": 2}),
    (2, {"extrapolate": 0.0}),
    (4, {"extrapolate": 0.0}),
    (3, {"full_end": 2}),
    (3, {"full_end": 2, "todo": 2.0}),
    (3, {"full_start": 0.3, "todo": 2.0}),
    (3, {"full_start": 0.3}),
    (3, {"full_start": 0.4}),
    (3, {"full_end": 3}),
    (3, {"full_start": 0.16, "todo": 2.0}),
    (3, {"full_start": 0.12, "todo": 2.0}),
    (2, {"full_end": 3}),
    (2, {"full_end": 3, "todo": 2.0}),
    (3, {"full_end": 3, "full_start": 0.3}),
    (3, {"full_end": 3, "todo": 2.0}),
    (3, {"todo": 2.0}),
    # Candidates for the default (issue: ToDo 2 + reuse every 3 keeps ref-sdxl's min SSIM at 0.842 < 0.85 at 25
    # steps): today's schedule with one more full step at the end, or a longer full start, or a shorter line.
    (3, {"full_end": 4, "short_run": 25, "todo": 2.0}),
    (3, {"full_end": 3, "short_run": 25, "full_start": 0.24, "todo": 2.0}),
    (3, {"full_end": 3, "short_run": 25, "extrapolate": 0.25, "todo": 2.0}),
    # Issue #37: fewer full steps (about 10 of 25 for 2x on SD1.5, 12 on SDXL). The interval schedule with a
    # shorter start and one in four between; the steps spaced by the logarithm of the noise (the DiTs'
    # schedule) with the first two and the last few full; the line over log sigma.
    (4, {"full_start": 0.12, "full_end": 3, "short_run": 25, "todo": 2.0}),
    (3, {"full_start": 0.12, "full_end": 3, "short_run": 25, "todo": 2.0}),
    (3.5, {"kind": "noise", "full_first": 2, "full_end": 3, "todo": 2.0}),
    (3, {"kind": "noise", "full_first": 2, "full_end": 3, "todo": 2.0}),
    (3, {"kind": "noise", "full_first": 2, "full_end": 4, "todo": 2.0}),
    (4, {"full_start": 0.12, "full_end": 3, "short_run": 25, "by_sigma": "log", "todo": 2.0}),
    (3.5, {"kind": "noise", "full_first": 2, "full_end": 3, "by_sigma": "log", "todo": 2.0}),
    # The parabola through the last three full steps; other reaches of the line.
    (3, {"full_start": 0.12, "full_end": 3, "short_run": 25, "order": 2, "todo": 2.0}),
    (3, {"full_start": 0.12, "full_end": 3, "short_run": 25, "order": 2, "extrapolate": 1.0, "todo": 2.0}),
    (4, {"full_start": 0.12, "full_end": 3, "short_run": 25, "order": 2, "todo": 2.0}),
    (3, {"full_start": 0.12, "full_end": 3, "short_run": 25, "extrapolate": 0.75, "todo": 2.0}),
    (3, {"full_start": 0.12, "full_end": 3, "short_run": 25, "extrapolate": 0.35, "todo": 2.0}),
    (3, {"kind": "noise", "full_first": 2, "full_end": 4, "order": 2, "todo": 2.0}),
    (3, {"kind": "noise", "full_first": 3, "full_end": 4, "todo": 2.0}),
    # 12 full steps of 25 with the last four full (a start of two) and the line's reach per model: `ref-sdxl`
    # kept more with a third of the line, `ref-sd1` with three quarters.
    (3, {"full_start": 0.08, "full_end": 4, "short_run": 25, "todo": 2.0}),
    (3, {"full_start": 0.08, "full_end": 4, "short_run": 25, "extrapolate": 0.35, "todo": 2.0}),
    (3, {"full_start": 0.08, "full_end": 4, "short_run": 25, "extrapolate": 0.75, "todo": 2.0}),
    (3, {"full_start": 0.12, "full_end": 3, "short_run": 25, "extrapolate": 0.6, "todo": 2.0}),
    # Samplers the shipped rule stands reuse down for (DPM++ 2M, Karras sigmas): measured with
    # ``--any-sampler --sampler dpmpp_2m --scheduler karras``; the shipped schedule, the low-noise calls in full
    # (as with UniPC on the DiTs), the schedule by the noise.
    (3, {"any_sigmas": True, "full_end": 4, "short_run": 25, "min_steps": 10, "todo": 2.0}),
    (3, {"any_sigmas": True, "full_end": 4, "short_run": 25, "min_steps": 10, "full_below": 0.5, "todo": 2.0}),
    (3, {"any_sigmas": True, "full_end": 4, "short_run": 25, "min_steps": 10, "full_below": 1.0, "todo": 2.0}),
    (3, {"any_sigmas": True, "kind": "noise", "full_first": 2, "full_end": 4, "todo": 2.0}),
    (3, {"any_sigmas": True, "kind": "noise", "full_first": 2, "full_end": 4, "full_below": 0.5, "todo": 2.0}),
    (3, {"any_sigmas": True, "full_start": 0.3, "full_end": 4, "short_run": 25, "min_steps": 10, "todo": 2.0}),
    # The families' own plans (``plans.UNET_LONG_RUN_PLANS``: SD1.x's, then SDXL's) with the low-noise calls in full.
    *(
        (
            3,
            {
                "any_sigmas": True,
                "full_start": start,
                "full_end": end,
                "short_run": 25,
                "min_steps": 10,
                "extrapolate": reach,
                "full_below": below,
                "todo": 2.0,
            },
        )
        for start, end, reach in ((0.12, 3, 0.75), (0.08, 4, 0.5))
        for below in (1.0, 2.0)
    ),
    # SDXL's plan with one more full step at the start (13 of 25: the calls EasyCache 0.4 computes there), with
    # ToDo 2 and alone.
    (3, {"full_start": 0.12, "full_end": 4, "short_run": 25, "todo": 2.0}),
    (3, {"full_start": 0.12, "full_end": 4, "short_run": 25}),
    (3, {"full_start": 0.08, "full_end": 4, "short_run": 25}),
    # The same count of full steps or fewer, with more of them at the start and one in 4 between (the second
    # generation loses its picture in the first reusing steps): SDXL's reach, then SD1.x's.
    (4, {"full_start": 0.12, "full_end": 4, "short_run": 25, "todo": 2.0}),
    (4, {"full_start": 0.12, "full_end": 5, "short_run": 25, "todo": 2.0}),
    (4, {"full_start": 0.16, "full_end": 4, "short_run": 25, "todo": 2.0}),
    (4, {"full_start": 0.16, "full_end": 3, "short_run": 25, "extrapolate": 0.75, "todo": 2.0}),
    (4, {"full_start": 0.16, "full_end": 4, "short_run": 25, "extrapolate": 0.75, "todo": 2.0}),
    # Issue #60: Spectrum's 13-of-25 shape (four full steps at the start, one in three between, the last four)
    # with ours' prediction, SD1.x's reach; with ToDo 2 and alone.
    (3, {"full_start": 0.159, "full_end": 3, "short_run": 25, "extrapolate": 0.75, "todo": 2.0}),
    (3, {"full_start": 0.159, "full_end": 3, "short_run": 25, "extrapolate": 0.75}),
    (3, {"full_start": 0.159, "full_end": 3, "short_run": 25, "todo": 2.0}),
    # Guards on what every reusing call computes (the first inner layer's input): the rate guard (the boundary's
    # change predicted from that input's moves), the first-block guard and the line guard, on SDXL's plan and on
    # plans with fewer scheduled full steps (one in 4; none between the start's two and the end's four).
    *(
        (interval, {"full_start": 0.08, "full_end": 4, "short_run": 25, guard: value, "todo": 2.0})
        for interval in (3, 4, 25)
        for guard, values in (("rate_guard", (0.05, 0.1, 0.2, 0.4, 0.8)), ("first_block_guard", (0.1, 0.2)))
        for value in values
    ),
    *(
        (25, {"full_start": 0.08, "full_end": 4, "short_run": 25, "line_guard": value, "todo": 2.0})
        for value in (0.01, 0.02, 0.03, 0.05)
    ),
)


def dit_variants(video: bool, other_step: float | None) -> tuple:
    """DiTs: the schedule, the blocks that run at every call, the prediction; ``other_step``: the step along the
    line other than the family's (None: a half step on Flux, a whole one on Wan)."""
    return (
        (4, {"fixed_intervals": True}),
        (6, {"fixed_intervals": True}),
        (8, {"fixed_intervals": True}),
        (4, {"outer": (1, 1)}),
        (6, {"outer": (1, 1)}),
        (6, {"extrapolate": 0.0}),
        # The step along the line the other family takes (Flux a whole one, Wan and Qwen-Image half of one).
        *((interval, {"extrapolate": other_step or (1.0 if video else 0.5)}) for interval in (3, 4, 6, 8)),
        (6, {"full_below": 0.0}),
        # The first steps in full, as every peer runs them (EasyCache 15%, MagCache 20%): the real models'
        # residual grows fast there (Flux.1 1.21, 1.12, 1.08, 1.06 per step; Qwen-Image 1.64, 1.45, 1.19).
        *((interval, {"warm_up": share}) for interval in (3, 4) for share in (0.05, 0.1, 0.15)),
        # The same with a shorter step along the line (the first line is drawn through close early steps).
        *((3, {"warm_up": 0.1, "extrapolate": step}) for step in (0.0, 0.5)),
    )
