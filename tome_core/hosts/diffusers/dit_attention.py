"""diffusers: ToDo on DiT attention (the engine's ``SequenceDownsample``): the image keys and values are downsampled
on their grid after the rotary embedding; queries and text stay whole, a mask gives the kept keys their share in
joint attention. Our processor holds diffusers' own of the family (Flux, SD3, Wan; diffusers 0.39.0), computes
through the module's own layers, and hands it every call it cannot reduce (a mask of the caller's, fused
projections, a backend without masks where one is needed, another layout, Flux's and SD3's under context
parallelism; Wan's there downsamples each process's shard where it is whole rows). The grid comes from the
transformer call (a pre-hook): Flux's ``img_ids``, SD3's and Wan's input shape and patch size.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from ...downsample import downsample_grid, downsampled_grid
from ...joint_attention import ImageTokens, SequenceDownsample
from ..shared import dit_families

log = logging.getLogger("tome_patch")

_STATE = "_tome_patch_dit_attention"
_HOOK = "_tome_patch_dit_attention_hook"
# The attention backends that take an additive mask (the kept image keys' share of the softmax needs one).
MASKED_BACKENDS = (None, "native", "_native_math", "_native_efficient", "_native_cudnn")


class _CallState:
    """What the transformer call in progress looks like: its image grid, or None (leave attention as it is)."""

    def __init__(self, family: str, reducer: SequenceDownsample, allowed: Callable[[float], bool], scale: float):
        self.family = family
        self.reducer = reducer
        self.allowed = allowed
        self.timestep_scale = scale
        self.grid = None  # Flux: ImageTokens (the ids say where); SD3 and Wan: the grid (frames, h, w)
        self.patch = None
        self.told_parallel = False
        self.shards: dict[tuple, list | None] = {}  # (grid, rank, processes): that process's shard as grids
        self.suspended = False  # a calibration's run without ToDo (``calibrate.DitJob``): attention as diffusers'

    def before_call(self, module, args, kwargs):
        self.grid = None
        if self.suspended:
            return None
        timestep = kwargs.get("timestep")  # the pipelines pass it by name; a call without it counts as in range
        if timestep is not None and not self.allowed(float(torch.as_tensor(timestep).max()) * self.timestep_scale):
            return None
        if self.family == "Flux":
            img_ids = kwargs.get("img_ids")
            if isinstance(img_ids, torch.Tensor) and img_ids.dim() in (2, 3):
                self.grid = flux_image_tokens(img_ids)
            return None
        x = args[0] if args else kwargs.get("hidden_states")
        patch = _patch_of(module)
        if isinstance(x, torch.Tensor) and patch is not None and x.dim() == len(patch) + 2:
            self.grid = tuple(math.ceil(n / p) for n, p in zip(x.shape[2:], patch, strict=True))
            if len(self.grid) == 2:
                self.grid = (1, *self.grid)
        return None

    def after_call(self, module, args, kwargs, output):
        self.grid = None
        return None


def _patch_of(transformer) -> tuple[int, ...] | None:
    patch = getattr(getattr(transformer, "config", None), "patch_size", None)
    if isinstance(patch, int):
        return (patch, patch)
    if isinstance(patch, (tuple, list)) and all(isinstance(p, int) for p in patch):
        return tuple(patch)
    return None


def flux_image_tokens(img_ids: torch.Tensor) -> ImageTokens | None:
    """The image grid of a Flux call from its ``img_ids`` (kind 0, row, column), or None where not one raster grid."""
    ids = img_ids[0] if img_ids.dim() == 3 else img_ids
    ids = ids.detach().to("cpu", torch.float64)
    image = int((ids[:, 0] == 0).sum())
    if image == 0 or bool((ids[:image, 0] != 0).any()):
        return None
    rows = int(ids[:image, 1].max()) + 1
    cols = int(ids[:image, 2].max()) + 1
    if rows * cols != image:
        return None
    expected_rows = torch.arange(rows, dtype=torch.float64).repeat_interleave(cols)
    if not torch.equal(ids[:image, 1], expected_rows):
        return None
    return ImageTokens((1, rows, cols), after=ids.shape[0] - image)


def shard_grids(grid, rank: int, processes: int) -> list[tuple[int, int, int]] | None:
    """``rank``'s shard of the flattened ``grid`` (diffusers splits the sequence as ``tensor_split``) as whole grids
    in sequence order (a frame's last rows, whole frames, a frame's first rows); None where a shard cuts a row."""
    frames, h, w = grid
    size, extra = divmod(frames * h * w, processes)
    start = rank * size + min(rank, extra)
    end = start + size + (rank < extra)
    if start % w or end % w:
        return None
    grids, row, last = [], start // w, end // w
    while row < last:
        if row % h == 0 and last - row >= h:
            grids.append(((last - row) // h, h, w))
        else:
            grids.append((1, min(h - row % h, last - row), w))
        row += grids[-1][0] * grids[-1][1]
    return grids


def _backend_name(backend):
    return backend.value if hasattr(backend, "value") else backend


class _HeldProcessor:
    """Ours, holding diffusers' processor of the family: reduces what it can, hands the rest to the held one."""

    def __init__(self, state: _CallState, original):
        self.state = state
        self.original = original

    # diffusers' ``set_attention_backend`` and ``enable_parallelism`` set these on the processor: the held one's.
    @property
    def _attention_backend(self):
        return getattr(self.original, "_attention_backend", None)

    @_attention_backend.setter
    def _attention_backend(self, value):
        self.original._attention_backend = value

    @property
    def _parallel_config(self):
        return getattr(self.original, "_parallel_config", None)

    @_parallel_config.setter
    def _parallel_config(self, value):
        self.original._parallel_config = value

    def held(self) -> bool:
        """Under context parallelism joint attention (Flux, SD3) runs as diffusers' own: a shard holds text and image
        tokens, and the kept keys' share would need a mask across the shards, which is not done here."""
        if self._parallel_config is None:
            return False
        if not self.state.told_parallel:
            self.state.told_parallel = True
            log.info(
                "ToMe Patch: ToDo is left out under context parallelism (enable_parallelism) on this family's joint "
                "attention: each process holds a shard of the image and text tokens; attention runs as diffusers' own."
            )
        return True

    def shard(self, grid) -> list | None:
        """This process's shard of ``grid`` as whole grids, where every process keeps as many keys (the attention's
        exchanges need equal sizes); None: ToDo is left out, with one log line."""
        mesh = getattr(getattr(self._parallel_config, "context_parallel_config", None), "_flattened_mesh", None)
        if mesh is None:
            return self._left_out()
        import torch.distributed as dist

        key = (grid, dist.get_rank(mesh.get_group()), mesh.size())
        if key not in self.state.shards:
            self.state.shards[key] = self._shards(*key)
        return self.state.shards[key] or self._left_out()

    def _shards(self, grid, rank: int, processes: int) -> list | None:
        reducer = self.state.reducer
        every = [shard_grids(grid, r, processes) for r in range(processes)]
        if any(grids is None for grids in every) or not reducer.worth_reducing(math.prod(grid)):
            return None
        factor = reducer.settings.downsample_factor
        kept = {sum(math.prod(downsampled_grid(g, factor, reducer.time_factor)) for g in grids) for grids in every}
        return every[rank] if len(kept) == 1 else None

    def _left_out(self) -> None:
        if not self.state.told_parallel:
            self.state.told_parallel = True
            log.info(
                "ToMe Patch: ToDo is left out under context parallelism (enable_parallelism): a process's shard of "
                "the video tokens cuts a row of their grid, or the shards would keep unequal numbers of keys; "
                "attention runs as diffusers' own."
            )
        return None

    def _reduce_shard(self, k, v, grids: list, dim: int):
        """(k, v) with each whole grid of this process's shard downsampled on its own."""
        reducer, sizes = self.state.reducer, [math.prod(g) for g in grids]
        s = reducer.settings

        def down(x):
            parts = x.split(sizes, dim)
            return torch.cat(
                [
                    downsample_grid(
                        p, g, s.downsample_factor, reducer.time_factor, s.downsample_method, reducer._nearest, dim
                    )  # fmt: skip
                    for p, g in zip(parts, grids, strict=True)
                ],
                dim,
            )

        return down(k), down(v)

    def _reduce(self, k, v, tokens: ImageTokens, dim: int, needs_mask: bool):
        """(k, v, mask) with the image keys and values downsampled, or (k, v, None) unchanged."""
        reduced = self.state.reducer.keys_values(k, v, tokens, dim)
        if reduced is None or (reduced[2] is not None and not needs_mask):
            return k, v, None
        return reduced


class TodoFluxProcessor(_HeldProcessor):
    """diffusers' ``FluxAttnProcessor`` with ToDo on the image keys and values."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        tokens = self.state.grid
        if (
            tokens is None
            or attention_mask is not None
            or getattr(attn, "fused_projections", False)
            or _backend_name(self._attention_backend) not in MASKED_BACKENDS
            or self.held()
        ):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        joint = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        q, k, v = (attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states))
        q, k, v = (x.unflatten(-1, (attn.heads, -1)) for x in (q, k, v))  # (batch, tokens, heads, head_dim)
        q, k = attn.norm_q(q), attn.norm_k(k)
        if joint:
            text = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            tq, tk, tv = (proj(encoder_hidden_states).unflatten(-1, (attn.heads, -1)) for proj in text)
            tq, tk = attn.norm_added_q(tq), attn.norm_added_k(tk)
            q, k, v = (torch.cat(pair, dim=1) for pair in ((tq, q), (tk, k), (tv, v)))
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        k, v, mask = self._reduce(k, v, tokens, 1, needs_mask=True)
        out = dispatch_attention_fn(q, k, v, attn_mask=mask, backend=self._attention_backend)
        out = out.flatten(2, 3).to(q.dtype)
        if not joint:
            return out
        text_out, image_out = out.split_with_sizes([encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())


class TodoJointProcessor(_HeldProcessor):
    """diffusers' ``JointAttnProcessor2_0`` (SD3, SD3.5) with ToDo on the image keys and values."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        grid = self.state.grid
        if grid is None or attention_mask is not None or args or kwargs or hidden_states.dim() != 3 or self.held():
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        batch, image = hidden_states.shape[:2]

        def heads(x):  # (batch, tokens, channels) -> (batch, heads, tokens, head_dim)
            return x.unflatten(-1, (attn.heads, -1)).transpose(1, 2)

        q, k, v = (heads(proj(hidden_states)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        text = 0
        if encoder_hidden_states is not None:
            text = encoder_hidden_states.shape[1]
            tq, tk, tv = (heads(p(encoder_hidden_states)) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                tq = attn.norm_added_q(tq)
            if attn.norm_added_k is not None:
                tk = attn.norm_added_k(tk)
            q, k, v = (torch.cat(pair, dim=2) for pair in ((q, tq), (k, tk), (v, tv)))
        k, v, mask = self._reduce(k, v, ImageTokens(grid, after=text, before=0), 2, needs_mask=True)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(batch, -1, q.shape[1] * q.shape[3]).to(q.dtype)
        image_out = attn.to_out[1](attn.to_out[0](out[:, :image]))
        if encoder_hidden_states is None:
            return image_out
        text_out = out[:, image:]
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return image_out, text_out


def _wan_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding: each (even, odd) channel pair of ``x`` turned by ``cos`` / ``sin``."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2).type_as(x)


class TodoWanProcessor(_HeldProcessor):
    """diffusers' ``WanAttnProcessor`` with ToDo on the video tokens' keys and values (self-attention only)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        grid = self.state.grid
        # Under context parallelism each process downsamples its own shard, where the shard is whole rows.
        parallel = grid is not None and encoder_hidden_states is None and self._parallel_config is not None
        shards = self.shard(grid) if parallel else None
        if (
            grid is None
            or encoder_hidden_states is not None  # the cross-attention to the text
            or attention_mask is not None
            or getattr(attn, "fused_projections", False)
            or getattr(attn, "add_k_proj", None) is not None
            or (parallel and (shards is None or sum(map(math.prod, shards)) != hidden_states.shape[1]))
        ):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)  # across the heads, before they are split
        q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (q, k, v))  # (batch, tokens, heads, head_dim)
        if rotary_emb is not None:
            q, k = _wan_rotary(q, *rotary_emb), _wan_rotary(k, *rotary_emb)
        if shards is None:
            k, v, _ = self._reduce(k, v, ImageTokens(grid, before=0), 1, needs_mask=False)  # all grid: no bias
        else:
            k, v = self._reduce_shard(k, v, shards, 1)
        out = dispatch_attention_fn(q, k, v, backend=self._attention_backend, parallel_config=self._parallel_config)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


PROCESSORS = {
    "Flux": (("FluxAttnProcessor", "FluxAttnProcessor2_0"), TodoFluxProcessor),
    "SD3": (("JointAttnProcessor2_0",), TodoJointProcessor),
    "Wan": (("WanAttnProcessor", "WanAttnProcessor2_0"), TodoWanProcessor),
}


def install(transformer, settings, allowed: Callable[[float], bool], family: str, timestep_scale: float) -> bool:
    """ToDo on ``transformer``'s attention; False where it reduces nothing here (left as it is): also for a family
    with no processors of ours (``PROCESSORS``; Flux.2, Qwen-Image, Z-Image, HunyuanVideo 1.5 and LTX-Video in
    diffusers 0.39.0 have attention processors of their own, which this module does not know)."""
    if family not in PROCESSORS:
        return False
    reducer = SequenceDownsample(settings, min_tokens=dit_families.family(family).todo_min_image_tokens)
    if reducer.does_nothing:
        return False
    names, ours = PROCESSORS[family]
    state = _CallState(family, reducer, allowed, timestep_scale)
    replaced = 0
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if type(processor).__name__ in names and hasattr(module, "set_processor"):
            module.processor = ours(state, processor)
            replaced += 1
    if not replaced:
        return False
    transformer.__dict__[_STATE] = state
    transformer.__dict__[_HOOK] = (
        transformer.register_forward_pre_hook(torch.compiler.disable(state.before_call), with_kwargs=True),
        transformer.register_forward_hook(torch.compiler.disable(state.after_call), with_kwargs=True, always_call=True),
    )
    return True


def installed(transformer) -> bool:
    return _STATE in transformer.__dict__


def state_of(transformer) -> _CallState | None:
    """The transformer's ToDo state (None: no ToDo here), for a calibration to switch it off for a run."""
    return transformer.__dict__.get(_STATE)


def remove(transformer) -> None:
    """Put every held processor back and remove the hooks; a no-op where nothing is installed."""
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if isinstance(processor, _HeldProcessor):
            module.processor = processor.original
    transformer.__dict__.pop(_STATE, None)
    for handle in transformer.__dict__.pop(_HOOK, ()):
        handle.remove()
