"""Hardening in a real ComfyUI 0.3.75: bad inputs, isolation between clones and jobs, exceptions, determinism."""

from __future__ import annotations

import copy
import random
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

HW = (16, 16)


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def model():
    return host.tiny_model("sd15")


def run(m, **kwargs):
    """A short sampling run (2 steps) at HW."""
    return host.sample(m, **{"latent_hw": HW, "steps": 2, **kwargs})


def patch(node_classes, model, **values):
    """The advanced node with its defaults for everything not given (as a fresh node in a workflow)."""
    node = node_classes["ToMePatchAdvanced"]
    inputs = {"model": model}
    for spec in node.GET_SCHEMA().inputs[1:]:
        inputs[spec.id] = spec.default
    inputs.update(values)
    return host.run_node(node, **inputs)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"ratio": -0.1}, "ratio must be a number from 0.0 to 0.75, got -0.1"),
        ({"ratio": float("nan")}, "ratio must be a number from 0.0 to 0.75, got nan"),
        ({"ratio": 0.6, "sx": 2, "sy": 1}, "ratio must be a number from 0 to 0.5 for a 2x1 stride"),
        ({"downsample_factor": 0.0}, "downsample_factor must be a number from 1.0 to 8.0, got 0.0"),
        ({"method": "merge"}, "method must be one of 'tome', 'todo', got 'merge'"),
        ({"start_percent": 0.7, "end_percent": 0.2}, "start_percent must not be above end_percent"),
        ({"ratio": "0.5"}, "ratio must be a number from 0.0 to 0.75, got '0.5'"),
        ({"sx": 2.5}, "sx must be a number from 1 to 8, got 2.5"),
        ({"seed": -1}, "seed must be a number from 0 to"),
        ({"max_downsample": "3"}, "max_downsample must be one of"),
        ({"downsample_method": None}, "downsample_method must be one of 'nearest-exact'"),
        ({"use_rand": 1}, "use_rand must be true or false, got 1"),
        ({"end_percent": [1.0]}, "end_percent must be a number from 0.0 to 1.0"),
    ],
)
def test_bad_inputs_stop_the_node_with_a_clear_error(node_classes, model, values, message):
    before = copy.deepcopy(model.model_options)
    with pytest.raises(ValueError) as err:
        patch(node_classes, model, **values)
    assert message in str(err.value)
    assert model.model_options == before  # nothing was patched: the error comes before any sampling


def test_two_clones_alternately_and_from_two_threads_never_mix(node_classes, model):
    tome = patch(node_classes, model, method="tome", ratio=0.5, skip_when_slower=False, use_rand=True, seed=3)
    todo = patch(node_classes, model, method="todo", downsample_factor=2.0, skip_when_slower=False)
    alone = {"tome": run(tome), "todo": run(todo)}
    assert not torch.equal(alone["tome"], alone["todo"])
    for name, clone in (("todo", todo), ("tome", tome), ("todo", todo), ("tome", tome)):
        assert torch.equal(run(clone), alone[name])

    # Threads: one UNet evaluation per call (ComfyUI's sampler loop itself is not meant to run concurrently).
    latent = torch.randn(2, 4, *HW, generator=torch.Generator().manual_seed(0))
    single = {name: host.unet_output(m, latent) for name, m in (("tome", tome), ("todo", todo))}
    results, errors = {"tome": [], "todo": []}, []

    def worker(name, clone):
        try:
            for _ in range(2):
                results[name].append(host.unet_output(clone, latent))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=item) for item in (("tome", tome), ("todo", todo))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for name in ("tome", "todo"):
        assert len(results[name]) == 2
        assert all(torch.equal(out, single[name]) for out in results[name])


def test_no_state_survives_from_one_job_to_the_next(node_classes, model):
    patched = patch(node_classes, model, method="tome", skip_when_slower=False, use_rand=True, end_percent=0.6)
    first = host.sample(patched, latent_hw=(15, 23), batch=2, seed=1)
    host.sample(patched, latent_hw=(24, 9), batch=3, seed=2, steps=2)  # another size, batch and schedule
    assert torch.equal(host.sample(patched, latent_hw=(15, 23), batch=2, seed=1), first)


class FailOnSecondStep:
    """Another node's attn1 patch that raises in the middle of sampling (second UNet call)."""

    def __init__(self):
        self.sigmas_seen = []

    def __call__(self, n, context, value, extra_options):
        sigma = float(extra_options["sigmas"].max())
        if sigma not in self.sigmas_seen:
            self.sigmas_seen.append(sigma)
        if len(self.sigmas_seen) >= 2:
            raise RuntimeError("foreign patch failed")
        return n, context, value


@pytest.mark.parametrize("method", ["tome", "todo"])
def test_an_exception_mid_sampling_leaves_nothing_behind(node_classes, model, method):
    never_patched = run(model, batch=2)
    ours = patch(node_classes, model, method=method, skip_when_slower=False)
    ours_before = run(ours, batch=2)

    failing = ours.clone()
    failing.set_model_attn1_patch(FailOnSecondStep())
    with pytest.raises(RuntimeError, match="foreign patch failed"):
        run(failing, batch=2)

    assert torch.equal(run(model, batch=2), never_patched)
    assert torch.equal(run(ours, batch=2), ours_before)
    turned_off = patch(node_classes, ours, method="tome", ratio=0.0)
    assert torch.equal(run(turned_off, batch=2), never_patched)


def test_global_random_state_after_sampling_is_as_without_the_patch(node_classes, model):
    def states_after(m):
        random.seed(11)
        np.random.seed(11)
        run(m, batch=2)
        return torch.get_rng_state(), random.getstate(), np.random.get_state()[1]

    torch_plain, py_plain, np_plain = states_after(model)
    seeded = patch(node_classes, model, method="tome", skip_when_slower=False, use_rand=True, seed=9)
    torch_patched, py_patched, np_patched = states_after(seeded)
    assert torch.equal(torch_patched, torch_plain)
    assert py_patched == py_plain
    assert np.array_equal(np_patched, np_plain)


SAMPLE_SCRIPT = textwrap.dedent(
    """
    import hashlib, sys
    sys.path.insert(0, "tests")
    from hosts import comfy_host as host
    nodes = host.load_our_package()
    node = nodes["ToMePatchAdvanced"]
    inputs = {spec.id: spec.default for spec in node.GET_SCHEMA().inputs[1:]}
    inputs.update(model=host.tiny_model("sd15"), skip_when_slower=False, use_rand=True, seed=5)
    out = host.sample(host.run_node(node, **inputs), latent_hw=(15, 23), batch=2, steps=2)
    print("HASH", hashlib.sha256(out.contiguous().numpy().tobytes()).hexdigest())
    """
)


def test_seeded_output_is_bit_identical_across_processes():
    # Two fresh processes (fresh hash seeds, fresh caches, fresh generators) must produce the same bits.
    hashes = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", SAMPLE_SCRIPT],
            cwd=host.REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        hashes.append(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("HASH")))
    assert hashes[0] == hashes[1]


@pytest.mark.parametrize("step_range", [False, True])
def test_patched_unet_compiles_without_graph_breaks(node_classes, model, step_range):
    """The tiny UNet with our hooks under torch.compile, as ComfyUI's TorchCompileModel compiles it.

    The test host runs ComfyUI's SDPA attention, as ComfyUI does on GPUs (its CPU attention reads free memory with
    psutil, a graph break of its own), so a graph break here is our hooks'. Dynamo decides graph breaks while
    tracing, before a backend runs: the "eager" backend finds them without inductor's long compile and runs the
    same kernels, so compiled and eager outputs are bit-identical.
    """
    patched = patch(
        node_classes,
        model,
        method="tome",
        skip_when_slower=False,
        use_rand=True,
        merge_crossattn=True,
        seed=2,
        end_percent=0.7 if step_range else 1.0,
    )
    unet = patched.model.diffusion_model
    latent = torch.randn(2, 4, *HW, generator=torch.Generator().manual_seed(1))
    context = host.conditioning("sd15", 2)[0][0]
    options = dict(patched.model_options["transformer_options"], sigmas=torch.full((2,), 5.0))
    if step_range:
        # As in sampling: the apply_model wrapper takes the step decision outside the compiled diffusion model.
        (wrapper,) = patched.get_wrappers("apply_model", "tome_patch")
        wrapper(lambda *args, **kwargs: None, latent, torch.full((2,), 5.0), transformer_options=options)
        assert options["tome_patch_active"] is True

    def forward(x, transformer_options=options):
        return unet(x, timesteps=torch.full((2,), 500.0), context=context, transformer_options=transformer_options)

    torch._dynamo.reset()
    with torch.no_grad():
        eager = forward(latent)
        # fullgraph: any graph break fails the trace, with Dynamo's reason (one trace, no separate explain)
        compiled = torch.compile(forward, backend="eager", fullgraph=True)(latent)
        unpatched = forward(latent, transformer_options={})
    torch._dynamo.reset()
    assert torch.equal(compiled, eager)
    assert not torch.equal(eager, unpatched)  # the hooks really reduced something
