"""The calibration's engine (``tome_core.calibration``): the target's range, the latent score, the bounded search,
the key by content and the kept file (atomic, two writers, files it cannot read set aside). No host."""

from __future__ import annotations

import json
import logging
import multiprocessing

import pytest
import torch

from tome_core.calibration import (
    MAX_RUNS,
    Calibration,
    CalibrationResult,
    KeptCalibrations,
    calibration_key,
    check_target,
    key_id,
    latent_ssim,
    tensors_fingerprint,
)
from tome_core.calibration.fingerprint import kin_id, patches_fingerprint
from tome_core.calibration.search import asked_of_samples
from tome_core.calibration.store import SetAsideError
from tome_core.reuse import Spacing

EULER = Spacing(0.15, 3).schedule(3)  # the default's Euler plan


@pytest.mark.parametrize("target", [0.5, 1.0, 1.5, "high", None])
def test_a_target_out_of_range_is_refused_by_name(target):
    with pytest.raises(ValueError, match=r"calibration_target must be a number from 0.8 to 0.999"):
        check_target(target)


def test_the_latent_score_is_one_for_the_same_latent_and_falls_with_the_difference():
    reference = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(latent_ssim(reference, reference), torch.ones(2))
    small, large = (reference + scale * torch.randn_like(reference) for scale in (0.05, 0.5))
    assert (latent_ssim(large, reference) < latent_ssim(small, reference)).all()
    assert latent_ssim(torch.randn(1, 16, 3, 8, 8), torch.randn(1, 16, 3, 8, 8)).shape == (1,)  # video: 5 dims
    with pytest.raises(ValueError, match="different shapes"):
        latent_ssim(reference, reference[:, :2])


def sampler_whose_picture_grows_with_the_computed_steps(reference, steps, seen):
    """A stand-in job: its latent's miss shrinks as more steps are computed (None: the unpatched run)."""

    def sample(schedule):
        seen.append(None if schedule is None else schedule.full_steps(steps))
        if schedule is None:
            return reference.clone()
        miss = 1.0 - schedule.full_steps(steps) / steps
        noise = torch.randn(reference.shape, generator=torch.Generator().manual_seed(1))
        return reference + miss * noise

    return sample


def test_the_search_keeps_the_fewest_computed_steps_at_the_target_in_at_most_six_runs():
    reference = torch.randn(2, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    seen = []
    calibration = Calibration(EULER, 25, target=0.9)
    result = calibration.run(sampler_whose_picture_grows_with_the_computed_steps(reference, 25, seen))
    assert seen[0] is None and len(seen) == result.runs <= MAX_RUNS
    scores = dict(result.tried)
    asked = asked_of_samples(0.9)
    assert 0.9 < asked < 1.0 and result.asked == asked
    assert result.spacing is not None and result.worst >= asked and scores[result.computed] == result.worst
    # every count it tried below the kept one missed what is asked, and the next count down was tried
    assert all(score < asked for count, score in result.tried if count < result.computed)
    counts = [spacing.schedule(spacing.every).full_steps(25) for spacing in calibration.candidates]
    below = [count for count in counts if count < result.computed]
    assert not below or max(below) in scores


def test_where_no_candidate_keeps_the_target_every_step_runs_and_it_says_so():
    reference = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    result = Calibration(EULER, 25, target=0.999).run(
        sampler_whose_picture_grows_with_the_computed_steps(reference, 25, [])
    )
    assert result.spacing is None and result.computed == 25 and "every step runs in full" in result.words()


def test_the_plans_own_spacing_is_the_candidate_for_its_count_and_the_first_tried():
    for steps in (12, 20, 25, 30):
        calibration = Calibration(EULER, steps)
        first = calibration.candidates[calibration.first]
        assert [s for s in range(steps) if first.schedule(first.every).is_full(s, steps)] == [
            s for s in range(steps) if EULER.is_full(s, steps)
        ]


def test_a_run_too_short_to_forecast_has_no_candidates():
    assert Calibration(EULER, 8).candidates == []


def test_a_weight_patch_strength_or_another_model_is_another_key():
    weights = {"a": torch.arange(10.0), "b": torch.ones(3, 3)}
    changed = {**weights, "b": weights["b"] * 1.001}
    assert tensors_fingerprint(weights.items()) == tensors_fingerprint(list(weights.items())[::-1])
    assert tensors_fingerprint(weights.items()) != tensors_fingerprint(changed.items())
    lora = {"b": [(1.0, ("lora", (torch.ones(3, 1), torch.ones(1, 3), 1.0, None)), 1.0, None, None)]}
    stronger = {"b": [(0.8, lora["b"][0][1], 1.0, None, None)]}
    assert patches_fingerprint(lora) != patches_fingerprint(stronger) != patches_fingerprint({})

    def key(**changes):
        fields = dict(model="m", patches="p", sampler="euler", sigmas=[14.6, 1.0, 0.0], cfg=7.0, shape=(4, 64, 64),
                      version="0.1.0")  # fmt: skip
        return key_id(calibration_key(**{**fields, **changes}))

    assert len({key(), key(patches="q"), key(sigmas=[14.6, 2.0, 0.0]), key(cfg=6.0), key(shape=(4, 64, 96))}) == 5


RESULT = CalibrationResult(25, 0.98, Spacing(0.15, 3, every=4), 11, 0.985, 5, ((13, 0.99), (11, 0.985)))


def test_the_kept_result_reads_back_as_written(tmp_path):
    store = KeptCalibrations(tmp_path / "calibrations.json")
    assert store.get("k") is None
    store.put("k", {"model": "m"}, RESULT, {"seeds": 2})
    assert store.get("k") == RESULT
    assert json.loads((tmp_path / "calibrations.json").read_text())["entries"]["k"]["seeds"] == 2


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": "tome-patch calibrations", "format_version": 0,
                                                             "entries": {}})])  # fmt: skip
def test_a_file_it_cannot_read_is_set_aside_with_one_line(tmp_path, caplog, text):
    path = tmp_path / "calibrations.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="tome_patch"), pytest.raises(SetAsideError):
        KeptCalibrations(path).get("k")
    assert len(caplog.records) == 1 and "set aside" in caplog.records[0].getMessage()
    assert not path.exists() and len(list(tmp_path.glob("calibrations.json.set-aside-*"))) == 1
    KeptCalibrations(path).put("k", {}, RESULT)
    assert KeptCalibrations(path).get("k") == RESULT


def _write_many(path: str, writer: int) -> None:
    store = KeptCalibrations(path)
    for index in range(15):
        store.put(f"{writer}-{index}", {}, RESULT)


def test_two_writers_at_once_lose_nothing(tmp_path):
    path = str(tmp_path / "calibrations.json")
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_many, args=(path, writer)) for writer in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(120)
    assert [writer.exitcode for writer in writers] == [0, 0]
    entries = json.loads(open(path).read())["entries"]
    assert sorted(entries) == sorted(f"{w}-{i}" for w in range(2) for i in range(15))


def test_the_picture_shows_both_latents_their_difference_and_the_computed_steps():
    from tome_core.calibration import draw_report, step_changes

    denoised = [torch.full((1, 4, 8, 8), float(value)) for value in (1, 2, 2.5, 2.75)]
    changes = step_changes(denoised)
    assert changes == [0.0, 1.0, 0.25, 0.1]
    reference = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    image = draw_report(reference, reference, changes, computed={0, 1})
    assert image.shape == (192 + 4 + 96, 3 * 192 + 2 * 4, 3)
    assert torch.equal(image[:192, 2 * (192 + 4) :], torch.zeros(192, 192, 3))  # no difference: black
    bottom = image[-1]
    step_width = image.shape[1] // 4
    assert bottom[step_width + 1, 0] == 1.0 and bottom[2 * step_width + 1, 0] < 0.5  # step 1 computed, step 2 not


def test_a_count_that_keeps_the_target_but_not_what_is_asked_of_the_samples_is_not_kept():
    reference = torch.randn(2, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    sample = sampler_whose_picture_grows_with_the_computed_steps(reference, 25, [])
    plain = Calibration(EULER, 25, target=0.9, share=1.0).run(sample)  # the samples asked for the target itself
    assert plain.asked == pytest.approx(0.9) and plain.worst >= 0.9
    scores = dict(plain.tried)
    # a share that asks for more than the plain result's score: that count is no longer enough
    share = (1.0 - plain.worst - 0.001) / 0.1
    strict = Calibration(EULER, 25, target=0.9, share=share).run(sample)
    assert strict.computed > plain.computed and strict.worst >= strict.asked > scores[plain.computed]
    assert f"asked {strict.asked:.4f}" in strict.words()
    assert CalibrationResult.from_dict(strict.as_dict()).asked == strict.asked
    # a loss share asks for more as the target rises, and never for more than a perfect score
    assert asked_of_samples(0.95) < asked_of_samples(0.98) < asked_of_samples(0.999) < 1.0


def test_each_count_is_tried_at_the_placement_nearest_the_plans_own():
    from tome_core.calibration.candidates import candidates

    chosen = candidates(EULER, 25)
    counts = [spacing.schedule(spacing.every).full_steps(25) for spacing in chosen]
    assert counts == sorted(set(counts)) and max(counts) < 25
    assert Spacing(0.15, 3, every=3) in chosen  # the default's own, for its count (13 of 25)
    for spacing in chosen:  # the default's first share and last steps where the count allows
        assert abs(spacing.full_start - 0.15) <= 0.05 + 1e-9


def _key(sigmas, **changes) -> dict:
    fields = dict(model="m", patches="p", sampler="euler", sigmas=sigmas, cfg=7.0, shape=(4, 64, 64), version="0.1")
    return calibration_key(**{**fields, **changes})


def _karras(steps: int, high: float = 14.6, low: float = 0.03, rho: float = 7.0) -> list[float]:
    ramp = [i / (steps - 1) for i in range(steps)]
    return [(high ** (1 / rho) + t * (low ** (1 / rho) - high ** (1 / rho))) ** rho for t in ramp] + [0.0]


def test_another_step_count_of_the_same_job_is_kin_and_anything_else_is_not():
    assert kin_id(_key(_karras(20))) == kin_id(_key(_karras(25))) == kin_id(_key(_karras(30)))
    assert key_id(_key(_karras(20))) != key_id(_key(_karras(25)))
    others = [_key(_karras(25), cfg=6.0), _key(_karras(25), patches="q"), _key(_karras(25, high=7.0)),
              _key([14.6 * (1 - i / 25) for i in range(25)] + [0.0])]  # fmt: skip
    assert all(kin_id(other) != kin_id(_key(_karras(20))) for other in others)


def test_the_nearest_other_step_count_kept_is_offered_and_nothing_else(tmp_path):
    store = KeptCalibrations(tmp_path / "calibrations.json")
    assert store.nearest(_key(_karras(25)), 25) is None
    far = CalibrationResult(40, 0.98, Spacing(0.15, 3, every=4), 16, 0.99, 4)
    near = CalibrationResult(20, 0.98, Spacing(0.15, 3, every=3), 10, 0.99, 4)
    none_kept = CalibrationResult(24, 0.98, None, 24, 1.0, 6)
    for result in (far, near, none_kept):
        store.put(key_id(_key(_karras(result.steps))), _key(_karras(result.steps)), result)
    store.put("same count", _key(_karras(25)), RESULT)
    store.put("other cfg", _key(_karras(26), cfg=5.0), CalibrationResult(26, 0.98, Spacing(0.15, 3), 9, 0.99, 4))
    assert store.nearest(_key(_karras(25)), 25) == near  # not 24 (nothing kept), not 26 (another CFG)
    assert store.nearest(_key(_karras(40)), 40) == RESULT


def test_a_plan_from_another_step_count_is_tried_first_and_checked_at_its_neighbour():
    reference = torch.randn(2, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    grows = sampler_whose_picture_grows_with_the_computed_steps
    plain = Calibration(EULER, 25, target=0.9).run(grows(reference, 25, []))
    other = CalibrationResult(20, 0.9, Spacing(0.15, 3), round(plain.computed * 20 / 25), 0.95, 5)
    seen = []
    calibration = Calibration(EULER, 25, target=0.9)
    calibration.start_from(other)
    result = calibration.run(grows(reference, 25, seen))
    assert result.computed == plain.computed and result.spacing == plain.spacing
    counts = [s.schedule(s.every).full_steps(25) for s in calibration.candidates]
    assert seen[1] == min(counts, key=lambda count: abs(count - other.computed / 20 * 25))
    assert result.runs <= 3 < plain.runs  # the plan transfers: its count and the one below it, after the unpatched run
    wrong = Calibration(EULER, 25, target=0.9)
    wrong.start_from(CalibrationResult(20, 0.9, Spacing(0.15, 3), 4, 0.95, 5))  # a plan far too sparse here
    assert wrong.run(grows(reference, 25, [])).computed == plain.computed


def test_a_dits_candidates_are_its_familys_plan_at_other_intervals_one_per_planned_count():
    from tome_core.calibration.candidates import planned, with_interval
    from tome_core.hosts.shared import dit_families

    wan = dit_families_wan()
    levels = [1.0 - step / 28 for step in range(28)]
    calibration = Calibration.for_dit(wan, 28, levels)
    assert calibration.counts == sorted(set(calibration.counts)) and max(calibration.counts) < 28
    for (interval, last), option in zip(calibration.candidates, calibration.options, strict=True):
        assert 2 <= interval <= 8 and 0 <= last <= round(0.6 * 28)
        assert option.schedule == with_interval(wan, interval, last)
        assert (option.schedule.first_block_guard, option.schedule.line_guard) == (wan.first_block_guard, 0.1)
    assert calibration.counts[calibration.first] == planned(wan, 28, levels)  # the family's own count first
    assert max(calibration.counts) > 20  # the last steps in full reach the counts above one in 2
    # Flux caps runs under 25 steps at one in 2; a candidate's interval holds at any length.
    flux = Calibration.for_dit(dit_families.auto_schedule("Flux"), 20)
    assert len(flux.candidates) > 1 and min(flux.counts) < 10


def test_a_dit_keeps_the_interval_that_computed_fewest_where_a_guard_adds_steps():
    from tome_core.calibration import with_interval

    reference = torch.randn(2, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    calibration = Calibration.for_dit(dit_families_wan(), 28)
    counts = dict(zip(calibration.candidates, calibration.counts, strict=True))
    ran = []

    def sample(schedule):
        ran.append(schedule)
        return reference.clone()  # every candidate keeps the picture

    # The guards compute more on a sparser plan: the fewest planned steps computed the most.
    fewest = with_interval(dit_families_wan(), *min(counts, key=counts.get))
    result = calibration.run(sample, counted=lambda: 27 if ran[-1] == fewest else None)
    assert fewest in ran
    assert result.interval is not None and result.spacing is None and result.kept
    assert result.computed == min(count for count, _ in result.tried) < 27
    assert all(plan is None or plan.first_block_guard == 0.15 for plan in ran)  # the family's guards, as they are
    assert CalibrationResult.from_dict(json.loads(json.dumps(result.as_dict()))) == result
    assert "the family's plan at one step in" in result.words()


def dit_families_wan():
    from tome_core.hosts.shared import dit_families

    return dit_families.auto_schedule("Wan")  # every 6, with its first-block guards


def test_where_todo_alone_loses_the_picture_the_search_goes_on_without_it():
    reference = torch.randn(2, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    runs = []
    calibration = Calibration(EULER, 25, target=0.98, reduces=True)

    def sample(schedule):
        runs.append((schedule, calibration.reducing))
        if calibration.reducing:  # the reduction alone loses the picture, at any count
            return reference + torch.randn(reference.shape, generator=torch.Generator().manual_seed(1))
        return reference.clone()

    result = calibration.run(sample)
    assert runs[0] == (None, False)  # the reference runs unreduced
    assert runs[1][1] and not runs[2][1] and runs[1][0] == runs[2][0]  # the same plan again without it
    assert not any(reducing for _, reducing in runs[2:])
    assert result.kept and not result.reduce and "without ToDo or ToMe" in result.words()
    assert CalibrationResult.from_dict(json.loads(json.dumps(result.as_dict()))) == result


def test_where_todo_keeps_the_picture_it_stays_and_a_patch_without_it_is_never_asked():
    reference = torch.randn(2, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    for reduces in (True, False):
        runs = []
        calibration = Calibration(EULER, 25, reduces=reduces)

        def sample(schedule, calibration=calibration, runs=runs):
            runs.append(calibration.reducing)
            return reference.clone()

        result = calibration.run(sample)
        assert runs == [False] + [reduces] * (len(runs) - 1) and result.reduce


def test_where_nothing_keeps_the_target_every_step_runs_unreduced():
    reference = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(reference.shape, generator=torch.Generator().manual_seed(1))
    calibration = Calibration(EULER, 25, reduces=True)
    result = calibration.run(lambda schedule: reference if schedule is None else reference + noise)
    assert not result.kept and not result.reduce and "without ToDo or ToMe" in result.words()


def test_where_todo_loses_more_than_the_forecast_the_search_goes_on_without_it_toward_more_steps():
    reference = torch.randn(2, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(reference.shape, generator=torch.Generator().manual_seed(1))
    runs = []
    calibration = Calibration(EULER, 25, reduces=True)

    def sample(schedule):  # unreduced, 18 computed steps keep the picture; the reduction never does
        if schedule is None:
            return reference
        count = schedule.full_steps(25)
        runs.append((count, calibration.reducing))
        loss = 1.0 if calibration.reducing else 0.0 if count >= 18 else 0.3
        return reference + loss * noise

    result = calibration.run(sample)
    (first, first_reducing), (again, again_reducing) = runs[:2]
    assert first == again and first < 18 and first_reducing and not again_reducing  # both missed; ToDo lost more
    assert not any(reducing for _, reducing in runs[1:])
    assert result.kept and not result.reduce and result.computed >= 18
