"""The benchmark's diffusers path: ``python -m tools.bench.speed --host diffusers [--model sd15|sdxl] ...``.

The setup of the ToMe documents' speed tables: diffusers' ``UNet2DConditionModel`` at full size (SD1.5 or SDXL)
with seeded random weights, PyTorch's SDPA attention (``AttnProcessor2_0``), fp16 on a GPU (fp32 on the CPU),
unpatched against this project and tomesd 0.1.3, each through its public entry point (``tome_core.apply_patch``,
``tomesd.apply_patch``, randomness off, at this project's default level).

Every patched row gets its own copy of the UNet's module tree that shares the very same weight tensors (a deep copy
with the parameters and buffers pre-seeded in the memo), patched once when the row is made: no weights are
duplicated, and nothing is patched or unpatched inside the timed calls. Rows look like those of
``tools.bench.unet.rows`` (``run(x, timesteps, context, y)``), so ``tools.bench.speed`` measures them the same way.
"""

from __future__ import annotations

import copy

import torch

from tools.common import host as bench_host
from tools.common.measure import relative_l2

from .rows import Row

HOST = "diffusers"


def diffusers_config(family: bench_host.Family) -> dict:
    """diffusers' UNet2DConditionModel config for one of the benchmark's families (the layout of its checkpoints)."""
    block_out = tuple(family.model_channels * m for m in family.channel_mult)
    attends = [depth > 0 for depth in family.depth]
    layers = [max(depth, 1) for depth in family.depth]
    layers[-1] = family.depth_middle  # the mid block takes the last entry (the last level has no attention on SD1)
    if family.num_heads > 0:
        heads = family.num_heads  # SD1.x: a fixed head count (diffusers' configs call it attention_head_dim)
    else:
        heads = tuple(channels // family.head_channels for channels in block_out)
    config = {
        "sample_size": 64,
        "in_channels": 4,
        "out_channels": 4,
        "layers_per_block": family.num_res_blocks,
        "block_out_channels": block_out,
        "down_block_types": tuple("CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attends),
        "up_block_types": tuple("CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attends)),
        "transformer_layers_per_block": tuple(layers),
        "attention_head_dim": heads,
        "use_linear_projection": family.linear,
        "cross_attention_dim": family.context_dim,
    }
    if family.adm_channels:  # SDXL: pooled text (1280) and six size numbers (6 x 256) added to the time embedding
        config.update(
            addition_embed_type="text_time",
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=family.adm_channels,
        )
    return config


def build_unet(family: bench_host.Family, dtype: torch.dtype, device: torch.device, seed: int):
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor2_0

    unet = UNet2DConditionModel(**diffusers_config(family))
    bench_host.initialise(unet, seed)  # on the CPU: the same weights whatever the device
    unet.set_attn_processor(AttnProcessor2_0())
    return unet.to(device=device, dtype=dtype).eval()


def sharing_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module tree over the same parameter and buffer tensors (patching it leaves ``module`` alone)."""
    memo = {id(tensor): tensor for tensor in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(module, memo)


def _runner(unet):
    def run(x, timesteps, context, y=None):
        return unet(x, timesteps, encoder_hidden_states=context, added_cond_kwargs=y).sample

    return run


class DiffusersBench:
    """The diffusers UNet, its patched copies and the inputs of one resolution (``tools.bench.speed``'s interface)."""

    def __init__(self, args, device: torch.device, dtype: torch.dtype):
        from tome_core import reduced_levels
        from tome_core.hosts.diffusers.unet_blocks import attention_levels

        self.args, self.device, self.dtype = args, device, dtype
        self.family = bench_host.FAMILIES[args.model]
        self.unet = build_unet(self.family, dtype, device, args.seed)
        self.levels = reduced_levels(0, attention_levels(self.unet))  # this project's default levels
        self.level = max(self.levels)
        self._patched: dict[str, torch.nn.Module] = {}

    def _patched_copy(self, name: str, patch) -> torch.nn.Module:
        if name not in self._patched:
            unet = sharing_copy(self.unet)
            patch(unet)
            self._patched[name] = unet
        return self._patched[name]

    def rows(self, size: tuple[int, int]) -> list[Row]:
        import tome_core

        args = self.args
        rows = [Row("unpatched", "unpatched", HOST, _runner(self.unet))]
        force = {"skip_when_slower": False} if args.force else {}
        suffix = " forced" if args.force else ""
        ours = [(f"ToMe {r:g}", {"method": "tome", "ratio": r}) for r in _floats(args.ratios)]
        ours += [(f"ToDo {f:g}", {"method": "todo", "downsample_factor": f}) for f in _factors(size)]
        for label, values in ours:
            name = f"ours {label}{suffix}"
            settings = {**values, "reuse_interval": 1, **force}  # single calls: the token reduction alone
            unet = self._patched_copy(name, lambda u, s=settings: tome_core.apply_patch(u, **s))
            rows.append(Row(name, "ours", HOST, _runner(unet), settings=settings))
        if not args.no_peers:
            import tomesd

            for ratio in _floats(args.peer_ratios):
                settings = {"ratio": ratio, "max_downsample": self.level, "use_rand": False}
                name = f"tomesd {ratio:g}"
                unet = self._patched_copy(name, lambda u, s=settings: tomesd.apply_patch(u, **s))
                rows.append(Row(name, "peer", HOST, _runner(unet), settings=settings))
        if args.only:
            keep = [part.strip() for part in args.only.split(",") if part.strip()]
            rows = [row for row in rows if row.group == "unpatched" or any(k in row.name for k in keep)]
        return rows

    def inputs(self, size: tuple[int, int], seed_offset: int = 0) -> dict:
        generator = torch.Generator().manual_seed(self.args.seed + 1 + seed_offset)
        batch, family = self.args.batch, self.family
        x = torch.randn(batch, 4, (size[0] + 7) // 8, (size[1] + 7) // 8, generator=generator)
        context = torch.randn(batch, 77, family.context_dim, generator=generator)
        as_model = {"device": self.device, "dtype": self.dtype}
        y = None
        if family.adm_channels:
            pooled = torch.randn(batch, family.adm_channels - 6 * 256, generator=generator)
            sizes = torch.tensor([[size[0], size[1], 0, 0, size[0], size[1]]], dtype=torch.float32).repeat(batch, 1)
            y = {"text_embeds": pooled.to(**as_model), "time_ids": sizes.to(**as_model)}
        return {
            "x": x.to(**as_model),
            "timesteps": torch.full((batch,), 500.0, device=self.device),
            "context": context.to(**as_model),
            "y": y,
        }

    def sampling_deviation(self, size: tuple[int, int], steps: int, log) -> dict[str, float]:
        """Relative L2 of a short run of diffusers' Euler scheduler (SD's schedule) against the unpatched run."""
        from diffusers import EulerDiscreteScheduler

        base = self.inputs(size, seed_offset=100)
        finals = {}
        for row in self.rows(size):
            scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
            scheduler.set_timesteps(steps, device=self.device)
            x = base["x"].float() * scheduler.init_noise_sigma
            with torch.inference_mode():
                for t in scheduler.timesteps:
                    x_in = scheduler.scale_model_input(x, t).to(self.dtype)
                    timesteps = t.float().expand(x.shape[0])
                    eps = row.run(x_in, timesteps, base["context"], base["y"]).float()
                    x = scheduler.step(eps, t, x).prev_sample
            finals[row.name] = x.cpu()
            log(f"  sampled {row.name}")
        return {name: relative_l2(final, finals["unpatched"]) for name, final in finals.items()}


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def _factors(size: tuple[int, int]) -> list[float]:
    return [2.0] + ([4.0] if min(size) >= 1536 else [])
