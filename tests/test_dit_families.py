"""The DiT family registry (``tome_core.hosts.shared.dit_families``): one record per family that every host reads,
with each host's class names, the measured defaults and the real model's published curve."""

from __future__ import annotations

import pytest

from tome_core.hosts.diffusers import dit_attention
from tome_core.hosts.diffusers import dit_reuse as diffusers_dit_reuse
from tome_core.hosts.shared import dit_families
from tome_core.reuse import NoiseSpacedSchedule, StepCountSchedule


def fake_model(*class_names: str, **blocks):
    """An object whose MRO carries ``class_names`` (the first its own), as a host's model would, with every block
    list a record's layout names (empty), or ``blocks`` (attribute: list of blocks) alone where given."""
    bases = (object,)
    for name in reversed(class_names):
        bases = (type(name, bases, {}),)
    model = bases[0]()
    lists = {attribute for f in dit_families.FAMILIES if f.blocks for _, attribute in f.blocks.lists}
    for attribute in lists if not blocks else ():
        setattr(model, attribute, [])
    for attribute, value in blocks.items():
        setattr(model, attribute, value)
    return model


class VideoBlock:
    """A block whose forward reads the text as LTX-Video's does (``context``)."""

    def forward(self, x, context=None, attention_mask=None, timestep=None, pe=None, transformer_options=None):
        return x


class AudioVideoBlock:
    """A block whose forward takes the (video, audio) tuple and reads two texts, as LTX-2's (ComfyUI 0.8.0
    ``BasicAVTransformerBlock``)."""

    def forward(self, x, v_context=None, a_context=None, attention_mask=None, transformer_options=None):
        return x


def test_each_name_and_alias_finds_one_record_and_an_unknown_name_the_nearest():
    names = [name for family in dit_families.FAMILIES for name in (family.name, *family.aliases)]
    assert len(names) == len(set(names))
    assert dit_families.family("Z-Image") is dit_families.family("Lumina 2")
    assert dit_families.family("no such family") is dit_families.OTHER
    assert dit_families.OTHER.curve is dit_families.FLUX_CURVE  # the nearest family's curve, not none
    for family in dit_families.FAMILIES:
        assert (family.blocks is None) == bool(family.no_reuse), family.name  # reuse reaches it, or the log says why
        if family.blocks is None:
            continue
        schedule = family.auto_schedule()
        assert isinstance(schedule, StepCountSchedule) and family.curve is not None
        # A family's default is guarded by its first block where one was measured, by the real curve elsewhere.
        guards = (family.first_block_guard, family.line_guard)
        guarded = guards != (None, None)
        assert schedule.curve is (None if guarded else family.curve)
        assert (schedule.first_block_guard, schedule.line_guard) == guards
        assert dit_families.auto_schedule(family.name) == schedule
    reused = [family for family in dit_families.FAMILIES if family.blocks is not None]
    guarded = [family.name for family in reused if family.auto_schedule().curve is None]
    # The families whose reference moves as the real model does (Qwen-Image passes the curve gate; Wan's curve is
    # real Wan 2.1's): guarded by their own first block.
    assert guarded == ["Qwen-Image", "Wan"]


@pytest.mark.parametrize(
    ("host", "classes", "expected"),
    (
        ("comfyui", ("Chroma",), "Flux"),
        ("comfyui", ("WanModel_X", "WanModel"), "Wan"),  # a subclass matches through its MRO
        ("comfyui", ("VaceWanModel", "WanModel"), "Wan VACE"),  # a variant's own record before its parent's
        ("comfyui", ("NextDiT",), "Lumina 2"),
        ("diffusers", ("Flux2Transformer2DModel",), "Flux"),
        ("diffusers", ("ZImageTransformer2DModel",), "Lumina 2"),
        ("neo", ("IntegratedFluxTransformer2DModel",), "Flux"),
        ("forge", ("IntegratedFluxTransformer2DModel",), "Flux"),
        ("comfyui", ("HiDreamImageTransformer2DModel",), "HiDream"),  # a record with no blocks: why, for the log
        ("comfyui", ("OmniGen2Transformer2DModel",), "OmniGen2"),
        ("comfyui", ("SomeNewDiT",), None),
        ("diffusers", ("Flux",), None),  # ComfyUI's name is not diffusers'
    ),
)
def test_a_model_is_found_by_its_hosts_class_names(host, classes, expected):
    record = dit_families.of_model(host, fake_model(*classes))
    assert (record.name if record is not None else None) == expected


@pytest.mark.parametrize(
    ("classes", "blocks", "expected", "unfit"),
    (
        # Both called MMDiT in ComfyUI: SD3's blocks are ``joint_blocks``, AuraFlow's double then single layers.
        (("MMDiT",), {"joint_blocks": []}, "SD3", None),
        (("MMDiT",), {"double_layers": [], "single_layers": []}, "AuraFlow", None),
        (("LTXAVModel", "LTXVModel"), {"transformer_blocks": [AudioVideoBlock()]}, "LTX-2", None),
        (("LTXVModel",), {"transformer_blocks": [VideoBlock()]}, "LTX-Video", None),
        # A subclass of LTX-Video's class whose blocks take other inputs is not given LTX-Video's record.
        (("SomeAVModel", "LTXVModel"), {"transformer_blocks": [AudioVideoBlock()]}, None, "LTX-Video"),
        (("MMDiT",), {"layers": []}, None, "AuraFlow"),
    ),
)
def test_a_family_is_recognised_by_its_class_and_what_its_blocks_take(classes, blocks, expected, unfit):
    model = fake_model(*classes, **blocks)
    record = dit_families.of_model("comfyui", model)
    assert (record.name if record is not None else None) == expected
    unfit_record = dit_families.named_but_unfit("comfyui", model)
    assert (unfit_record.name if unfit_record is not None else None) == unfit
    # diffusers' layouts are its door's own: the class name alone decides there.
    assert dit_families.of_model("diffusers", fake_model("LTXVideoTransformer3DModel")).name == "LTX-Video"


def test_a_host_the_registry_does_not_know_is_an_error():
    with pytest.raises(ValueError, match="host must be one of comfyui, diffusers, neo, forge"):
        dit_families.family("Flux").classes("invokeai")


def test_every_hosts_door_reads_its_families_from_the_registry():
    """Every family with ComfyUI classes has its block layout in its record (the block hook's, ComfyUI's and
    Neo's), found by the record's names; every diffusers transformer class with a layout or ToDo processors belongs
    to the family the registry names for it."""
    from tome_core.hosts.shared import dit_block_hook

    records = {family.name: family for family in dit_families.FAMILIES}
    for record in records.values():
        if record.comfyui:  # its blocks reached, or why not
            assert (record.blocks is not None) != bool(record.no_reuse), record.name
        for name in (record.name, *record.aliases):
            assert dit_block_hook.layout_named(name) is record.blocks
    assert dit_block_hook.layout_named("a family no record has") is None
    # diffusers' rows of argument names are keyed by the class the registry names, and every such class has one.
    named = {name for record in records.values() for name in record.diffusers}
    assert set(diffusers_dit_reuse.LAYOUTS) == named
    assert set(dit_attention.PROCESSORS) <= set(records)


def test_the_words_that_list_the_families_name_every_record():
    """The log's and the model input's tooltip's list of families (``SUPPORTED_WORDS``, made from the registry)
    names every record whose blocks ComfyUI reaches, so a family added to the registry is not left out of what the
    user reads; the models that run every block are not in it."""
    from tome_core.hosts.comfyui import dit_reuse as comfyui_dit_reuse

    for family in dit_families.FAMILIES:
        for name in (family.name, *family.aliases):
            if family.name in ("Flux", "SD3", "Wan", "HunyuanVideo"):  # named by their models' versions
                name = {"Flux": "Flux.1", "SD3": "SD3/SD3.5", "Wan": "Wan 2.x", "HunyuanVideo": "HunyuanVideo 1."}[name]
            listed = name in comfyui_dit_reuse.SUPPORTED_WORDS
            assert listed == (family.blocks is not None and bool(family.comfyui)), name


def test_the_guarded_families_guards_alone_decide_a_short_run_and_the_others_keep_the_cap():
    """Under 25 steps a plan reuses one step in two at most (``NoiseSpacedSchedule.short_run``), whatever the
    interval; Qwen-Image's and Wan's defaults lift that cap (their guards decide a short run's steps, measured on
    their references: docs/dit-measurements.md), the families guarded by a published curve keep it. From 25 steps
    on the plans are the same; under 10 steps every step runs in full either way."""
    levels = [1.0 - step / 20 for step in range(20)]
    qwen, wan = dit_families.auto_schedule("Qwen-Image"), dit_families.auto_schedule("Wan")
    capped, uncapped = NoiseSpacedSchedule(6), NoiseSpacedSchedule(6, short_run=0)
    assert qwen.for_run(20, levels).full == uncapped.for_run(20, levels).full == wan.for_run(20, levels).full
    assert len(uncapped.for_run(20, levels).full) < len(capped.for_run(20, levels).full)
    assert qwen.for_run(28).full == capped.for_run(28).full == wan.for_run(28).full
    assert qwen.for_run(9).full == wan.for_run(9).full == frozenset(range(9))
    for family in dit_families.FAMILIES:
        assert (family.short_run == 0) == family.guarded_by_first_block, family.name
    with pytest.raises(ValueError, match="short_run"):
        StepCountSchedule(((0, 6),), short_run=-1)
