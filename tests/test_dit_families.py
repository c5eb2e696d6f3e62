"""The DiT family registry (``tome_core.hosts.shared.dit_families``): one record per family that every host reads,
with each host's class names, the measured defaults and the real model's published curve."""

from __future__ import annotations

import pytest

from tome_core.hosts.diffusers import dit_attention
from tome_core.hosts.diffusers import dit_reuse as diffusers_dit_reuse
from tome_core.hosts.shared import dit_families
from tome_core.reuse import StepCountSchedule


def fake_model(*class_names: str):
    """An object whose MRO carries ``class_names`` (the first its own), as a host's model would."""
    bases = (object,)
    for name in reversed(class_names):
        bases = (type(name, bases, {}),)
    return bases[0]()


def test_each_name_and_alias_finds_one_record_and_an_unknown_name_the_nearest():
    names = [name for family in dit_families.FAMILIES for name in (family.name, *family.aliases)]
    assert len(names) == len(set(names))
    assert dit_families.family("Z-Image") is dit_families.family("Lumina 2")
    assert dit_families.family("no such family") is dit_families.OTHER
    assert dit_families.OTHER.curve is dit_families.FLUX_CURVE  # the nearest family's curve, not none
    for family in dit_families.FAMILIES:
        schedule = family.auto_schedule()
        assert isinstance(schedule, StepCountSchedule) and family.curve is not None
        # A family's default is guarded by its first block where one was measured, by the real curve elsewhere.
        guards = (family.first_block_guard, family.line_guard)
        guarded = guards != (None, None)
        assert schedule.curve is (None if guarded else family.curve)
        assert (schedule.first_block_guard, schedule.line_guard) == guards
        assert dit_families.auto_schedule(family.name) == schedule
    guarded = [family.name for family in dit_families.FAMILIES if family.auto_schedule().curve is None]
    assert guarded == ["Qwen-Image"]  # the one family with a reference that passes the curve gate


@pytest.mark.parametrize(
    ("host", "classes", "expected"),
    (
        ("comfyui", ("Chroma",), "Flux"),
        ("comfyui", ("VaceWanModel", "WanModel"), "Wan"),  # a subclass matches through its MRO
        ("comfyui", ("NextDiT",), "Lumina 2"),
        ("diffusers", ("Flux2Transformer2DModel",), "Flux"),
        ("diffusers", ("ZImageTransformer2DModel",), "Lumina 2"),
        ("neo", ("IntegratedFluxTransformer2DModel",), "Flux"),
        ("forge", ("IntegratedFluxTransformer2DModel",), "Flux"),
        ("comfyui", ("HiDreamImageTransformer2DModel",), None),
        ("diffusers", ("Flux",), None),  # ComfyUI's name is not diffusers'
    ),
)
def test_a_model_is_found_by_its_hosts_class_names(host, classes, expected):
    record = dit_families.of_model(host, fake_model(*classes))
    assert (record.name if record is not None else None) == expected


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
        assert (record.blocks is not None) == bool(record.comfyui), record.name
        for name in (record.name, *record.aliases):
            assert dit_block_hook.layout_named(name) is record.blocks
    assert dit_block_hook.layout_named("a family no record has") is None
    for class_name, layout in diffusers_dit_reuse.LAYOUTS.items():
        assert class_name in dit_families.family(layout.name).diffusers, class_name
    assert set(dit_attention.PROCESSORS) <= set(records)
