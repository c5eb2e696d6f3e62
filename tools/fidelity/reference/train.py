"""Train the reference models: ``python -m tools.fidelity.reference.train`` (about 1.5 hours on a 2-core CPU).

The classifier and the models are independent: ``--models`` and ``--no-classifier`` split the work into
processes that run in parallel (each gives the same weights as the whole command). A model's training can span
several sessions: every ``SAVE_EVERY`` steps it also writes its whole training state (weights, average,
optimiser, data generator, losses) to ``weights/<model>.resume.pt`` (ignored by git), and ``--resume`` goes on
from there, to the same weights as one uninterrupted run; the file is removed once the model is saved.

Deterministic from ``--seed`` on a given machine and thread count: the data stream, the initial weights and
the noise all come from seeded generators, and PyTorch is put in deterministic mode. The trained weights go to
``tools/fidelity/reference/weights/`` (safetensors, with the recipe and final losses in their metadata) and a summary
to ``tools/fidelity/reference/weights/training.json``.

What is trained, in order:
1. the attribute classifier, on freshly generated scenes (it judges the samples later);
2. each UNet (``ref-sd1``, ``ref-sdxl``) with its prompt encoder, as a v-prediction diffusion model on
   ComfyUI's discrete schedule (the UNet input is ``(x0 + sigma * eps) / sqrt(sigma^2 + 1)`` at a uniformly
   drawn timestep, exactly what ComfyUI feeds the UNet while sampling; the target is
   ``v = (eps - sigma * x0) / sqrt(sigma^2 + 1)``, what ComfyUI's V_PREDICTION turns back into the image), with
   10% of prompts replaced by the
   empty prompt (classifier-free guidance), AdamW, warm-up then cosine decay, and an exponential moving
   average of the weights, which is what is saved;
3. ``ref-flux`` the same way (same scenes, prompts, dropout, optimiser and average), as a flow-matching model on
   the schedule ComfyUI samples Flux.1-dev with (``ModelSamplingFlux``): input ``(1 - sigma) * x0 + sigma * eps``
   at a sigma drawn uniformly from that schedule's table, timestep ``sigma``, target ``eps - x0`` (what
   ComfyUI's CONST prediction turns back into the image), plain mean squared error. Its step count and
   learning rate are its own (``RECIPES``): a transformer step costs differently from a UNet step;
4. ``ref-wan`` (``--models ref-wan``) likewise on moving clips of the same scenes (``data.render_clip``), on
   the schedule ComfyUI samples Wan 2.1 with (``ModelSamplingDiscreteFlow``, shift 8; timestep 1000 sigma);
5. ``ref-qwen`` (``--models ref-qwen``) and ``ref-flux2`` (``--models ref-flux2``) as ``ref-flux``, each on the
   schedule ComfyUI samples its family with (``ModelSamplingFlux`` at ``supported_models.QwenImage``'s shift
   1.15, the same curve as the ModelSamplingAuraFlow 3.1 of ComfyUI's Qwen-Image workflow to within 2%; at
   ``Flux2``'s shift 2.02); ``ref-qwen``'s scenes as one-frame 3-D latents, ``ref-flux2``'s prompt padded to
   512 tokens, as ComfyUI feeds them.

6. the second generation (``--models ref-flux-v2`` / ``ref-qwen-v2``) as ``ref-flux-deep`` / ``ref-qwen`` on the
   16-channel latents of ``data.batch_v2``, with logit-normal time sampling (``TIME_SAMPLING``); their classifier
   with ``--models "" --classifier-scenes v2``.

Fine-tunes of a DiT reference (experiments on how its residual changes from step to step, not the committed
recipe): ``--init-from`` starts from saved weights (the average starts there too); ``--time-sampling
logit-normal`` draws the flow time as SD3 and Flux do (``sigmoid(u)``, ``u ~ N(0, 1)``, through the family's shift)
instead of uniformly from the schedule's table; ``--distill-cfg G`` distils classifier-free guidance into the
guidance embedding, as Flux.1-dev is: the teacher (the ``--init-from`` weights, frozen) predicts with and
without the prompt at the guidance it was trained with, and the student, fed ``G`` in its guidance embedding,
learns ``uncond + G (cond - uncond)`` (one call per step at CFG 1 then samples as the teacher does at CFG G).
``--open-scenes A`` adds an unprompted smooth field to the scenes (``data.open_up``). ``--out-dir`` writes the
weights elsewhere than the committed folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tools.common.host import initialise, setup_comfy

from . import data, models

CFG_DROPOUT = 0.1
EMA_DECAY = 0.998
MIN_SNR_GAMMA = 5.0  # min-SNR loss weighting for v (arXiv 2303.09556): faster convergence on a small budget
SAVE_EVERY = 250
LOG_EVERY = 100
# The options of the fine-tunes and experiments (each recorded with the weights).
FINE_TUNE = (
    "init_from",
    "time_sampling",
    "distill_cfg",
    "open_scenes",
    "warmup",
    "no_pooled",
    "no_guidance_constant",
)
# Per-model optimiser steps and peak learning rate, where ``--steps`` / ``--lr`` do not override them.
RECIPES = {
    "ref-sd1": (1500, 1e-3),
    "ref-sdxl": (1500, 1e-3),
    "ref-flux": (2000, 1e-3),
    "ref-flux-deep": (2000, 1e-3),
    "ref-wan": (2000, 1e-3),
    "ref-qwen": (2000, 1e-3),
    "ref-flux2": (2000, 1e-3),
    "ref-flux-v2": (2000, 1e-3),
    "ref-qwen-v2": (2000, 1e-3),
    "ref-sdxl-v2": (2500, 1e-3),
    "ref-sd1-v2": (2500, 1e-3),
}
# Flow time as each model is trained where ``--time-sampling`` does not say: the second generation as Flux.1 and
# SD3 are (logit-normal through the shift), the first uniformly over the schedule's table.
TIME_SAMPLING = {"ref-flux-v2": "logit-normal", "ref-qwen-v2": "logit-normal"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--resume", action="store_true", help="go on from a model's saved training state (weights/<model>.resume.pt)"
    )
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps per model (default: RECIPES)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: RECIPES)")
    parser.add_argument("--classifier-steps", type=int, default=800)
    parser.add_argument("--models", default="ref-sd1,ref-sdxl,ref-flux")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (results depend on it)")
    parser.add_argument("--no-classifier", action="store_true", help="keep the committed classifier")
    parser.add_argument(
        "--classifier-scenes",
        choices=("v1", "v2"),
        default="v1",
        help="the scenes the classifier learns: the first generation's (classifier) or the opened-up 64 px ones the "
        "-v2 references draw (classifier-v2)",
    )
    parser.add_argument("--init-from", default=None, help="start from these saved weights (a reference's file)")
    parser.add_argument(
        "--time-sampling",
        choices=("table", "logit-normal"),
        default=None,
        help="flow time: uniform over the schedule's table, or SD3/Flux's logit-normal(0, 1) through the shift "
        "(default: the model's, TIME_SAMPLING)",
    )
    parser.add_argument(
        "--distill-cfg", type=float, default=0.0, help="guidance distillation at this CFG (needs --init-from)"
    )
    parser.add_argument(
        "--open-scenes", type=float, default=0.0, help="an unprompted smooth field of this size on the scenes"
    )
    parser.add_argument(
        "--no-pooled",
        action="store_true",
        help="a Flux layout without the prompt in its modulation: the pooled vector held at zero (Qwen-Image has none)",
    )
    parser.add_argument(
        "--no-guidance-constant",
        action="store_true",
        help="a Flux.1 layout whose guidance embedding adds nothing to the modulation: its output layer held at zero "
        "(the file keeps the embedding, so ComfyUI still detects Flux.1-dev)",
    )
    parser.add_argument("--warmup", type=int, default=200, help="learning-rate warm-up steps")
    parser.add_argument("--out-dir", default=None, help="folder for the weights (default: the committed folder)")
    args = parser.parse_args(argv)
    if args.no_pooled and any(not models.is_flux(name) for name in args.models.split(",") if name):
        parser.error("--no-pooled is for the Flux layouts only (the pooled vector is Flux's y)")
    flux1 = all(models.is_flux(name) and not models.is_flux2(name) for name in args.models.split(",") if name)
    if args.no_guidance_constant and not flux1:
        parser.error("--no-guidance-constant is for the Flux.1 layouts only (Flux.1's guidance_in)")
    if args.distill_cfg and not args.init_from:
        parser.error("--distill-cfg needs --init-from (the teacher)")
    return args


def lr_at(step: int, total: int, peak: float, warmup: int = 200) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def debiased_ema(ema_state: dict, init_state: dict, updates: int) -> dict:
    """The moving average without its start: the first average is the first weights, which then keep a share
    ``EMA_DECAY ** (updates - 1)`` of the average (18% after 1000 steps at 0.998). Their output layer is zero,
    so that share shrinks every predicted noise and leaves noise in the samples; it is removed as Adam removes
    the bias of its moments: (average - share * first) / (1 - share), with the initial weights as the first."""
    share = EMA_DECAY ** (updates - 1)
    return {
        key: (value - share * init_state[key]) / (1.0 - share) if value.is_floating_point() else value
        for key, value in ema_state.items()
    }


def zero_start(name: str, diffusion_model) -> list[nn.Linear]:
    """The layers that start at zero. UNet: the output convolution (the usual diffusion-UNet init). Wan: the
    output layer (as Wan's own init). Flux: the output layer and every modulation (adaLN-Zero, as DiT): each
    block starts as the identity."""
    if models.is_video(name):
        return [diffusion_model.head.head]
    if models.is_qwen(name):  # Qwen-Image: the output projection and every modulation, as Flux
        layers = [diffusion_model.proj_out, diffusion_model.norm_out.linear]
        for block in diffusion_model.transformer_blocks:
            layers += [block.img_mod[-1], block.txt_mod[-1]]
        return layers
    if not models.is_flux(name):
        return [diffusion_model.out[-1]]
    layers = [diffusion_model.final_layer.linear, diffusion_model.final_layer.adaLN_modulation[-1]]
    if models.is_flux2(name):  # Flux.2: one modulation per kind of block, shared by the blocks
        return layers + [
            diffusion_model.double_stream_modulation_img.lin,
            diffusion_model.double_stream_modulation_txt.lin,
            diffusion_model.single_stream_modulation.lin,
        ]
    for block in diffusion_model.double_blocks:
        layers += [block.img_mod.lin, block.txt_mod.lin]
    return layers + [block.modulation.lin for block in diffusion_model.single_blocks]


def hold_at_zero(layer: nn.Linear) -> None:
    """Zero and freeze a linear layer, so that the saved file feeds zeros in sampling as in training. Used for the
    Flux layouts' pooled projection (``--no-pooled``: the prompt then reaches the model through its text tokens
    alone) and the guidance embedding's output layer (``--no-guidance-constant``: at the one guidance these
    references see, 3.5, the embedding is a constant added to every block's modulation vector; docs/dit.md, the
    second generation)."""
    with torch.no_grad():
        layer.weight.zero_()
        layer.bias.zero_()
    layer.requires_grad_(False)


def initial_weights(name: str, seed: int):
    """The diffusion model (ComfyUI BaseModel) and prompt encoder with the initial weights of a training run."""
    torch.manual_seed(seed)
    base = models.build_base_model(name)
    initialise(base.diffusion_model, seed)
    with torch.no_grad():  # zero-started output: faster to train
        for layer in zero_start(name, base.diffusion_model):
            layer.weight.zero_()
            if layer.bias is not None:  # Flux.2's layers have none
                layer.bias.zero_()
    return base, models.PromptEncoder(models.pooled_dim(name))


def draw_times(name: str, base, sigmas_table: torch.Tensor, n: int, how: str, generator) -> tuple:
    """(indices into ``sigmas_table``, the table they index): ``n`` noise levels, uniform over the schedule's table
    or (flow models) logit-normal(0, 1) as SD3 and Flux train, mapped through the family's shift."""
    if how == "table":
        return torch.randint(0, len(sigmas_table), (n,), generator=generator), sigmas_table
    if not models.is_dit(name):
        raise ValueError(f"logit-normal time sampling is for the flow-matching models, not {name}")
    time = torch.sigmoid(torch.randn(n, generator=generator))
    sampling = base.model_sampling
    return torch.arange(n), sampling.sigma(time * getattr(sampling, "multiplier", 1.0)).float()


def _copy_activation(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if isinstance(tensor, nn.Parameter) else tensor.clone()


def autograd_safe(flux: bool):
    """ComfyUI's Flux blocks add their residuals in place (``img += ...``, inference code), after a norm saved
    the same tensor for its backward pass, which autograd refuses. While training a Flux model, every
    activation autograd saves is a copy, so the unchanged ComfyUI model trains; UNets need nothing."""
    if not flux:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_copy_activation, lambda tensor: tensor)


def noised_pair(flux: bool, sigmas_table: torch.Tensor, t: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor):
    """(model input, sigma or timestep, target, loss weight per sample) for schedule indices ``t``, exactly as
    ComfyUI builds the model input while sampling (``calculate_input`` of the model's sampling). ``flux``: any
    flow-matching model (Flux, Wan); its second value is sigma, which the model's sampling turns into the
    timestep (Flux: sigma itself, Wan: 1000 sigma). Images or clips: ``x0`` of any rank."""
    sigma = sigmas_table[t].view(-1, *[1] * (x0.dim() - 1))
    if flux:  # flow matching, CONST: x_t on the straight line from x0 to eps
        return (1.0 - sigma) * x0 + sigma * eps, sigma.view(-1), eps - x0, torch.ones(len(t))
    scale = torch.rsqrt(sigma * sigma + 1.0)
    snr = 1.0 / (sigma.view(-1) ** 2)
    weight = torch.clamp(snr, max=MIN_SNR_GAMMA) / (snr + 1.0)
    return (x0 + sigma * eps) * scale, t.float(), (eps - sigma * x0) * scale, weight


def distilled_target(name: str, teacher, x_in, timestep, indices, size: int, cfg: float) -> tuple:
    """(the teacher's CFG-combined prediction at ``cfg``, the guidance the student is fed: ``cfg``); the teacher
    is fed the guidance it was trained with."""
    base, encoder = teacher
    with torch.no_grad():
        context, pooled = encoder(torch.cat((indices, models.PromptEncoder.empty(len(indices)))))
        both = base.diffusion_model(
            torch.cat((x_in, x_in)),
            torch.cat((timestep, timestep)),
            **models.model_inputs(name, base, context, pooled, size),
        )
    cond, uncond = both.chunk(2)
    return uncond + cfg * (cond - uncond), cfg


def save_average(name: str, ema, init_state: dict, updates: int, info: dict) -> None:
    state = debiased_ema(ema.module.state_dict(), init_state, updates)
    unet_state = {k[len("unet.") :]: v for k, v in state.items() if k.startswith("unet.")}
    encoder_state = {k[len("encoder.") :]: v for k, v in state.items() if k.startswith("encoder.")}
    models.save_reference(name, unet_state, encoder_state, info)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def classifier_batch(which: str, n: int, generator: torch.Generator) -> tuple:
    """(scenes, prompts) of the generation a classifier judges (the second's at 64 px)."""
    if which == "v2":
        latents, prompts = data.batch_v2(n, models.TRAIN_SIZE, generator)
        return data.v2_scenes(latents), prompts
    return data.batch(n, models.TRAIN_SIZE, generator)


def classifier_name(scenes: str) -> str:
    return "classifier-v2" if scenes == "v2" else "classifier"


def train_classifier(args) -> dict:
    torch.manual_seed(args.seed)
    classifier = models.AttributeClassifier()
    generator = torch.Generator().manual_seed(args.seed + 1)
    optimiser = torch.optim.AdamW(classifier.parameters(), lr=2e-3, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(args.classifier_steps):
        for group in optimiser.param_groups:
            group["lr"] = lr_at(step, args.classifier_steps, 2e-3, warmup=50)
        images, prompts = classifier_batch(args.classifier_scenes, 64, generator)
        # Robust to what a sampler leaves behind: a little noise and blur.
        images = images + torch.randn(images.shape, generator=generator) * 0.08 * torch.rand(1, generator=generator)
        if torch.rand(1, generator=generator) < 0.3:
            images = nn.functional.avg_pool2d(images, 3, 1, 1, count_include_pad=False)
        logits = classifier(images)
        loss = sum(loss_fn(out, target) for out, target in zip(logits, prompts.as_tensor().T, strict=True))
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        if step % 100 == 0 or step == args.classifier_steps - 1:
            log(f"classifier step {step}: loss {loss.item():.4f}")
    classifier.eval()
    test_gen = torch.Generator().manual_seed(args.seed + 2)
    with torch.no_grad():
        images, prompts = classifier_batch(args.classifier_scenes, 1024, test_gen)
        predicted = torch.stack([out.argmax(1) for out in classifier(images)], dim=1)
    correct = predicted == prompts.as_tensor()
    accuracy = {name: correct[:, i].float().mean().item() for i, name in enumerate(data.ATTRIBUTES)}
    log(f"classifier accuracy on 1024 fresh scenes: {accuracy}")
    models.WEIGHTS.mkdir(parents=True, exist_ok=True)
    weights = {k: v.contiguous() for k, v in classifier.state_dict().items()}
    save_file(weights, str(models.WEIGHTS / f"{classifier_name(args.classifier_scenes)}.safetensors"))
    return {"steps": args.classifier_steps, "final_loss": loss.item(), "accuracy_on_real": accuracy}


def resume_path(name: str):
    return models.WEIGHTS / f"{name}.resume.pt"


def save_training_state(name: str, recipe: dict, step: int, parts: dict, generator, losses, seconds: float) -> None:
    """Everything the loop needs to go on after ``step`` steps, written whole or not at all."""
    state = {key: part.state_dict() for key, part in parts.items()}
    state.update(recipe=recipe, step=step, generator=generator.get_state(), losses=losses, seconds=seconds)
    path = resume_path(name)
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    partial.replace(path)


def load_training_state(name: str, recipe: dict, parts: dict, generator) -> tuple[int, list, float]:
    """(steps done, losses, seconds spent) from the saved state of this recipe, or a fresh start."""
    path = resume_path(name)
    if not path.exists():
        log(f"{name}: no saved training state ({path.name}); starting afresh")
        return 0, [], 0.0
    state = torch.load(path, weights_only=False)
    if state["recipe"] != recipe:
        raise SystemExit(f"{path} is of another recipe ({state['recipe']}, not {recipe}): remove it or match it")
    for key, part in parts.items():
        part.load_state_dict(state[key])
    generator.set_state(state["generator"])
    log(f"{name}: resuming after step {state['step']} ({state['seconds'] / 60:.0f} min spent)")
    return state["step"], state["losses"], state["seconds"]


def train_model(name: str, args) -> dict:
    """One reference diffusion model (UNet or Flux) with its prompt encoder."""
    steps, peak_lr = RECIPES[name]
    steps = args.steps or steps
    peak_lr = args.lr or peak_lr
    flow = models.is_dit(name)
    base, encoder = initial_weights(name, args.seed)
    net = nn.ModuleDict({"unet": base.diffusion_model, "encoder": encoder}).train()
    teacher = None
    if args.init_from:
        start, start_encoder = models.load_reference(name, args.init_from)
        net.load_state_dict(nn.ModuleDict({"unet": start.diffusion_model, "encoder": start_encoder}).state_dict())
        if args.distill_cfg:
            teacher = (start, start_encoder)
    if args.no_pooled:
        hold_at_zero(encoder.pool)
    if args.no_guidance_constant:
        hold_at_zero(base.diffusion_model.guidance_in.out_layer)
    init_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY))
    optimiser = torch.optim.AdamW(net.parameters(), lr=peak_lr, weight_decay=0.01)
    sigmas_table = base.model_sampling.sigmas.float()
    generator = torch.Generator().manual_seed(args.seed + 10)
    size = models.train_size(name)
    time_sampling = args.time_sampling or TIME_SAMPLING.get(name, "table")
    recipe = {"steps": steps, "lr": peak_lr, "batch": args.batch, "seed": args.seed, "threads": args.threads}
    defaults = parse_args([])  # a fine-tune's options are its recipe's too (a committed recipe's states still match)
    recipe.update({key: getattr(args, key) for key in FINE_TUNE if getattr(args, key) != getattr(defaults, key)})
    parts = {"net": net, "ema": ema, "optimiser": optimiser}
    first, losses, spent = load_training_state(name, recipe, parts, generator) if args.resume else (0, [], 0.0)
    started = time.time() - spent
    for step in range(first, steps):
        for group in optimiser.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, args.warmup)
        x0, prompts = models.samples(name, args.batch, size, generator)
        if args.open_scenes:
            x0 = data.open_up(x0, args.open_scenes, generator)
        indices = prompts.as_tensor()
        drop = torch.rand(args.batch, generator=generator) < CFG_DROPOUT
        indices = torch.where(drop.view(-1, 1), models.PromptEncoder.empty(args.batch), indices)
        t, table = draw_times(name, base, sigmas_table, args.batch, time_sampling, generator)
        eps = torch.randn(x0.shape, generator=generator)
        x_in, timestep, target, weight = noised_pair(flow, table, t, x0, eps)
        if flow:
            timestep = base.model_sampling.timestep(timestep)
        guidance = models.FLUX_GUIDANCE
        if teacher is not None:
            target, guidance = distilled_target(name, teacher, x_in, timestep, indices, size, args.distill_cfg)
        with autograd_safe(flow and not models.is_qwen(name)):  # Qwen-Image's blocks add out of place
            context, pooled = encoder(indices)
            inputs = models.model_inputs(name, base, context, pooled, size, guidance)
            predicted = base.diffusion_model(x_in, timestep, **inputs)
        loss = (weight * (predicted - target).square().flatten(1).mean(dim=1)).mean()
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimiser.step()
        ema.update_parameters(net)
        losses.append(loss.item())
        if (step + 1) % SAVE_EVERY == 0 and step + 1 < steps:  # a usable checkpoint if stopped early
            save_average(name, ema, init_state, step + 1, {"model": name, "steps": step + 1})
            save_training_state(name, recipe, step + 1, parts, generator, losses, time.time() - started)
        if step % LOG_EVERY == 0 or step == steps - 1:
            recent = sum(losses[-200:]) / len(losses[-200:])
            rate = (time.time() - started) / (step + 1)  # over the whole run, sessions before included
            left = rate * (steps - step - 1) / 60
            log(f"{name} step {step}: loss {recent:.4f} ({rate:.2f} s/step, {left:.0f} min left)")
    final = sum(losses[-500:]) / len(losses[-500:])
    info = {
        "model": name,
        "steps": steps,
        "batch": args.batch,
        "lr": peak_lr,
        "seed": args.seed,
        "train_size": size,
        "time_sampling": time_sampling,
        "final_loss_last_500": round(final, 5),
        "minutes": round((time.time() - started) / 60, 1),
    }
    if args.init_from:  # a fine-tune or continuation: which weights it started from (the file's name, no folder)
        info.update(init_from=Path(args.init_from).name, steps_before=models.trained_steps(args.init_from))
    save_average(name, ema, init_state, steps, info)
    resume_path(name).unlink(missing_ok=True)
    log(f"{name}: saved, final loss {final:.4f}")
    return info


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    setup_comfy("cpu")
    if args.out_dir:
        models.WEIGHTS = Path(args.out_dir)
    summary = {"command": "python -m tools.fidelity.reference.train", "args": vars(args), "torch": torch.__version__}
    if not args.no_classifier:
        summary["classifier"] = train_classifier(args)
    names = [name for name in args.models.split(",") if name]  # --models "": the classifier alone
    for name in names:
        summary[name] = train_model(name, args)
    out = models.WEIGHTS / f"training-{'+'.join(names) or classifier_name(args.classifier_scenes)}.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
