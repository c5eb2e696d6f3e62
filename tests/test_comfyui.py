"""The node package inside a real ComfyUI 0.3.75: loaded by ComfyUI's loader, sampled through its KSampler."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

FAMILIES = ("sd15", "sdxl")


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def models():
    return {family: host.tiny_model(family) for family in FAMILIES}


patch = host.patch_with_node


def test_package_registers_both_nodes(node_classes):
    import nodes as comfy_nodes

    assert comfy_nodes.NODE_DISPLAY_NAME_MAPPINGS["ToMePatch"] == "ToMe Patch"
    assert comfy_nodes.NODE_DISPLAY_NAME_MAPPINGS["ToMePatchAdvanced"] == "ToMe Patch (Advanced)"
    schema = node_classes["ToMePatch"].GET_SCHEMA()
    assert schema.category == "model_patches/unet"
    names = [i.id for i in schema.inputs]
    assert names == [
        "model",
        "method",
        "ratio",
        "downsample_factor",
        "max_downsample",
        "start_percent",
        "end_percent",
        "skip_when_slower",
        "scope",
        "reuse_interval",
        "dit_settings",
        "reuse_plan",
    ]
    assert all(i.tooltip for i in schema.inputs)
    # Saved workflows keep widget values by position: both nodes only ever append inputs.
    advanced = [i.id for i in node_classes["ToMePatchAdvanced"].GET_SCHEMA().inputs]
    assert advanced == names[:-4] + [
        "sx",
        "sy",
        "use_rand",
        "seed",
        "merge_attn",
        "merge_crossattn",
        "downsample_method",
        "scope",
        "reuse_interval",
        "dit_settings",
        "reuse_plan",
        "calibration_target",
    ]


def test_each_input_says_which_method_it_belongs_to(node_classes):
    """The nodes keep every input (saved workflows), so each tooltip says which method (and scope) reads it."""
    words = {
        "method": "tome: ",  # the choice itself: says what each method does
        "ratio": "ToMe: ",
        "downsample_factor": "ToDo: ",
        "max_downsample": "ToMe and ToDo: ",
        "start_percent": "ToMe and ToDo: ",
        "end_percent": "ToMe and ToDo: ",
        "skip_when_slower": "ToMe and ToDo: ",
        "scope": "ToMe: ",
        "sx": "ToMe: ",
        "sy": "ToMe: ",
        "use_rand": "ToMe: ",
        "seed": "ToMe: ",
        "merge_attn": "ToMe, scope self-attention: ",
        "merge_crossattn": "ToMe, scope self-attention: ",
        "downsample_method": "ToDo: ",
        "reuse_interval": "ToMe and ToDo: ",
        "dit_settings": "DiTs: ",
        "reuse_plan": "ToMe and ToDo: ",
        "calibration_target": "ToMe and ToDo: ",
    }
    for node_id in ("ToMePatch", "ToMePatchAdvanced"):
        for spec in node_classes[node_id].GET_SCHEMA().inputs[1:]:
            assert spec.tooltip.startswith(words[spec.id]), (node_id, spec.id, spec.tooltip)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["tome", "todo"])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_patch_changes_sampling_on_odd_sizes(node_classes, models, family, method, batch):
    model = models[family]
    reference = host.sample(model, family, latent_hw=(15, 23), batch=batch)
    patched = patch(node_classes, model, method=method, skip_when_slower=False)
    out = host.sample(patched, family, latent_hw=(15, 23), batch=batch)
    assert out.shape == reference.shape
    assert torch.isfinite(out).all()
    assert not torch.equal(out, reference)


@pytest.mark.parametrize(
    "values",
    [
        {"method": "tome", "ratio": 0.0},
        {"method": "todo", "downsample_factor": 1.0},
        {"method": "tome", "start_percent": 0.5, "end_percent": 0.5},
        {"method": "todo", "start_percent": 0.3, "end_percent": 0.3},
    ],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_settings_that_do_nothing_are_bit_identical(node_classes, models, family, values):
    model = models[family]
    reference = host.sample(model, family, latent_hw=(15, 23), batch=2)
    patched = patch(node_classes, model, skip_when_slower=False, **values)
    assert torch.equal(host.sample(patched, family, latent_hw=(15, 23), batch=2), reference)


def test_default_settings_reduce_sdxl_at_its_finest_attention_level(node_classes, models):
    model = models["sdxl"]
    reference = host.sample(model, "sdxl", latent_hw=(16, 16))
    patched = patch(node_classes, model, skip_when_slower=False)  # max_downsample auto
    assert not torch.equal(host.sample(patched, "sdxl", latent_hw=(16, 16)), reference)
    only_level_one = patch(node_classes, model, skip_when_slower=False, max_downsample="1")
    assert torch.equal(host.sample(only_level_one, "sdxl", latent_hw=(16, 16)), reference)


def test_skip_when_slower_leaves_small_grids_alone(node_classes, models):
    """Bit for bit the unpatched output, and our hooks stay out of such calls altogether (they would cost every
    block a few Python calls for nothing); with the rule off they run."""
    model = models["sd15"]

    def sample_counting_blocks(patched) -> tuple[torch.Tensor, list]:
        reducer = patched.get_wrappers("apply_model", "tome_patch")[0].__self__.reducer
        calls = []
        start_block = reducer.start_block
        reducer.start_block = lambda *args, **kwargs: calls.append(1) or start_block(*args, **kwargs)
        return host.sample(patched, latent_hw=(15, 23)), calls

    reference = host.sample(model, latent_hw=(15, 23))
    out, calls = sample_counting_blocks(patch(node_classes, model, reuse_interval=1))
    assert torch.equal(out, reference) and calls == []
    out, calls = sample_counting_blocks(patch(node_classes, model, reuse_interval=1, skip_when_slower=False))
    assert calls and not torch.equal(out, reference)


def test_step_range_limits_the_patch(node_classes, models):
    model = models["sd15"]
    kwargs = dict(latent_hw=(15, 23), steps=4)
    reference = host.sample(model, **kwargs)
    full = host.sample(patch(node_classes, model, skip_when_slower=False), **kwargs)
    first_half = host.sample(patch(node_classes, model, skip_when_slower=False, end_percent=0.5), **kwargs)
    assert not torch.equal(first_half, reference)
    assert not torch.equal(first_half, full)


def test_input_model_is_never_changed(node_classes, models):
    model = models["sd15"]
    before = copy.deepcopy(model.model_options)
    patched = patch(node_classes, model, method="tome", skip_when_slower=False, merge_crossattn=True, advanced=True)
    assert patched is not model
    assert model.model_options == before
    patches = patched.model_options["transformer_options"]["patches"]
    assert {"attn1_patch", "attn1_output_patch", "attn2_patch", "attn2_output_patch"} <= set(patches)


def test_applying_twice_replaces_the_earlier_patch(node_classes, models):
    model = models["sd15"]
    once = patch(node_classes, model, method="todo", skip_when_slower=False)
    twice = patch(
        node_classes,
        patch(node_classes, model, method="tome", ratio=0.3, skip_when_slower=False),
        method="todo",
        skip_when_slower=False,
    )
    assert len(twice.model_options["transformer_options"]["patches"]["attn1_patch"]) == 1
    assert torch.equal(host.sample(twice, latent_hw=(15, 23)), host.sample(once, latent_hw=(15, 23)))
    # Turning it off on a patched model removes our hooks: bit-identical to never patched.
    off = patch(node_classes, once, ratio=0.0, method="tome")
    assert torch.equal(host.sample(off, latent_hw=(15, 23)), host.sample(model, latent_hw=(15, 23)))


def test_seeded_randomness_is_reproducible_and_leaves_the_global_rng_alone(node_classes, models):
    model = models["sd15"]
    host.sample(model, latent_hw=(15, 23), batch=3)
    state_unpatched = torch.get_rng_state()
    seeded = patch(node_classes, model, advanced=True, method="tome", skip_when_slower=False, use_rand=True, seed=7)
    first = host.sample(seeded, latent_hw=(15, 23), batch=3)
    second = host.sample(seeded, latent_hw=(15, 23), batch=3)
    assert torch.equal(torch.get_rng_state(), state_unpatched)  # the sampler's own seeding only
    assert torch.equal(first, second)
    other = patch(node_classes, model, advanced=True, method="tome", skip_when_slower=False, use_rand=True, seed=8)
    assert not torch.equal(host.sample(other, latent_hw=(15, 23), batch=3), first)


def builtin_tome(model, ratio=0.5):
    from comfy_extras.nodes_tomesd import TomePatchModel

    return TomePatchModel.execute(model, ratio).result[0]


@pytest.mark.parametrize("method,ratio", [("tome", 0.5), ("todo", 0.5), ("tome", 0.3)])
def test_chains_with_comfyui_builtin_tome(node_classes, models, method, ratio):
    model = models["sd15"]
    reference = host.sample(model, latent_hw=(16, 16))
    builtin_only = host.sample(builtin_tome(model), latent_hw=(16, 16))
    # Built-in first: it merges the queries, so our hooks find no grid at level 1 and leave those blocks alone.
    builtin_then_ours = patch(node_classes, builtin_tome(model), method=method, ratio=ratio, skip_when_slower=False)
    out = host.sample(builtin_then_ours, latent_hw=(16, 16))
    assert torch.isfinite(out).all() and not torch.equal(out, reference)
    assert torch.equal(out, builtin_only)
    # Ours first, then the built-in: both run, or the built-in steps back where our merge left it no grid.
    out = host.sample(
        builtin_tome(patch(node_classes, model, method=method, ratio=ratio, skip_when_slower=False)), latent_hw=(16, 16)
    )
    assert torch.isfinite(out).all() and not torch.equal(out, reference)


@pytest.mark.parametrize("ours_first", [True, False])
def test_composes_with_another_nodes_attn1_patch(node_classes, models, ours_first):
    model = models["sd15"]
    calls = []

    def scale_keys(n, context, value, extra_options):
        calls.append(n.shape[1])
        return n, context * 0.5, value

    def with_foreign(m):
        m = m.clone()
        m.set_model_attn1_patch(scale_keys)
        return m

    ours_kwargs = dict(method="tome", skip_when_slower=False)
    if ours_first:
        chained = with_foreign(patch(node_classes, model, **ours_kwargs))
    else:
        chained = patch(node_classes, with_foreign(model), **ours_kwargs)
    foreign_only = host.sample(with_foreign(model), latent_hw=(15, 23))
    calls.clear()
    out = host.sample(chained, latent_hw=(15, 23))
    assert calls, "the other node's patch must still run"
    assert torch.isfinite(out).all()
    assert not torch.equal(out, foreign_only)


def test_bad_value_is_a_clear_error_before_sampling(node_classes, models):
    with pytest.raises(ValueError, match="ratio must be a number from 0.0 to 0.75"):
        patch(node_classes, models["sd15"], ratio=0.9)
    with pytest.raises(ValueError, match="ratio must be a number from 0 to 0.5 for a 1x2 stride"):
        patch(node_classes, models["sd15"], advanced=True, ratio=0.6, sx=1, sy=2)


def test_whole_graph_through_the_prompt_executor(node_classes, tmp_path):
    """UNETLoader -> ToMe Patch -> KSampler as a prompt, validated and executed by ComfyUI's executor."""
    import comfy.supported_models
    import execution
    import folder_paths
    import nodes as comfy_nodes
    import safetensors.torch

    # A UNet that ComfyUI's detection takes for SD1.x (it needs model_channels 320 and context_dim 768), kept
    # small with one resolution step and one block per level.
    config = dict(
        host.SD15_TINY,
        model_channels=320,
        context_dim=768,
        num_heads=8,
        channel_mult=[1, 2],
        num_res_blocks=[1, 1],
        transformer_depth=[1, 1],
        transformer_depth_output=[1, 1, 1, 1],
    )
    sd15 = comfy.supported_models.SD15(config)
    sd15.set_inference_dtype(torch.float32, None)
    unet = sd15.get_model({}).diffusion_model
    host.initialise(unet, seed=5)
    (tmp_path / "unet").mkdir()
    safetensors.torch.save_file(unet.state_dict(), str(tmp_path / "unet" / "tiny_sd15.safetensors"))
    folder_paths.add_model_folder_path("diffusion_models", str(tmp_path / "unet"))

    ok = asyncio.run(
        comfy_nodes.load_custom_node(
            str(host.REPO_ROOT / "tests" / "hosts" / "comfy_graph_nodes"), module_parent="custom_nodes"
        )
    )
    assert ok
    captured = comfy_nodes.NODE_CLASS_MAPPINGS["TestCaptureLatent"].captured

    def prompt(ratio):
        return {
            "1": {
                "class_type": "UNETLoader",
                "inputs": {"unet_name": "tiny_sd15.safetensors", "weight_dtype": "default"},
            },
            "2": {
                "class_type": "ToMePatch",
                "inputs": {
                    "model": ["1", 0],
                    "method": "tome",
                    "ratio": ratio,
                    "downsample_factor": 2.0,
                    "max_downsample": "auto",
                    "start_percent": 0.0,
                    "end_percent": 1.0,
                    "skip_when_slower": False,
                },
            },
            "3": {"class_type": "TestRandomConditioning", "inputs": {"seed": 1}},
            "4": {"class_type": "TestRandomConditioning", "inputs": {"seed": 2}},
            "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 184, "height": 120, "batch_size": 2}},
            "6": {
                "class_type": "KSampler",
                "inputs": {
                    "model": ["2", 0],
                    "seed": 3,
                    "steps": 2,
                    "cfg": 5.0,
                    "sampler_name": "euler",
                    "scheduler": "normal",
                    "positive": ["3", 0],
                    "negative": ["4", 0],
                    "latent_image": ["5", 0],
                    "denoise": 1.0,
                },
            },
            "7": {"class_type": "TestCaptureLatent", "inputs": {"samples": ["6", 0], "key": f"ratio {ratio}"}},
        }

    class Server:
        client_id = None
        last_node_id = None

        def send_sync(self, *args, **kwargs):
            pass

    executor = execution.PromptExecutor(  # as ComfyUI's main.py (0.3.75, line 180) builds it
        Server(), cache_type=execution.CacheType.CLASSIC, cache_args={"lru": 0, "ram": 0}
    )
    for ratio in (0.0, 0.5):
        graph = prompt(ratio)
        valid = asyncio.run(execution.validate_prompt(f"p{ratio}", graph, None))
        assert valid[0], valid
        executor.execute(graph, f"p{ratio}", {}, valid[2])
        assert executor.success, executor.status_messages
    off, on = captured["ratio 0.0"], captured["ratio 0.5"]
    assert off.shape == on.shape == (2, 4, 15, 23)
    assert torch.isfinite(on).all() and not torch.equal(on, off)


def test_classic_api_offers_the_same_inputs_and_result(node_classes, models):
    """Older ComfyUI without comfy_api gets the classic classes: same inputs, defaults and patch."""
    import sys

    our_nodes = sys.modules[node_classes["ToMePatch"].__module__]
    for classic, v3 in (
        (our_nodes.ClassicToMePatch, "ToMePatch"),
        (our_nodes.ClassicToMePatchAdvanced, "ToMePatchAdvanced"),
    ):
        types = classic.INPUT_TYPES()
        inputs = {**types["required"], **types.get("optional", {})}
        schema_inputs = node_classes[v3].GET_SCHEMA().inputs
        assert list(inputs) == [i.id for i in schema_inputs]
        # Inputs added after the first release are optional in both APIs, so older prompts still validate.
        optional = {i.id for i in schema_inputs if i.optional}
        later = {"scope", "reuse_interval", "dit_settings", "reuse_plan"}
        later |= {"calibration_target"} if v3 == "ToMePatchAdvanced" else set()
        assert set(types.get("optional", {})) == optional == later
        for spec in schema_inputs[1:]:
            assert inputs[spec.id][1]["default"] == spec.default
            assert inputs[spec.id][1]["tooltip"] == spec.tooltip
    model = models["sd15"]
    values = dict(
        method="todo",
        ratio=0.5,
        downsample_factor=2.0,
        max_downsample="auto",
        start_percent=0.0,
        end_percent=1.0,
        skip_when_slower=False,
    )
    (classic_model,) = our_nodes.ClassicToMePatch().patch(model, **values)
    v3_model = patch(node_classes, model, **values)
    assert torch.equal(host.sample(classic_model, latent_hw=(15, 23)), host.sample(v3_model, latent_hw=(15, 23)))


def test_example_workflow_matches_the_node(node_classes):
    """The example workflow's widget values are positional: they must follow the node's inputs."""
    import json

    for path in (host.REPO_ROOT / "example_workflows").glob("*.json"):
        workflow = json.loads(path.read_text())
        (ours,) = [n for n in workflow["nodes"] if n["type"] == "ToMePatch"]
        inputs = node_classes["ToMePatch"].GET_SCHEMA().inputs[1:]
        assert len(ours["widgets_values"]) == len(inputs)
        values = {spec.id: value for spec, value in zip(inputs, ours["widgets_values"], strict=True)}
        family = "flux" if "Flux" in path.name else "wan" if "Wan" in path.name else None
        model = host.tiny_dit(family) if family else host.tiny_model("sd15")
        assert patch(node_classes, model, **values) is not model
