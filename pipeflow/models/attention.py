"""Attention as every pipeflow model computes it (``model.attention``): ``sdpa`` (the
default, torch's fused kernel: no ``s x s`` tensor outlives the call) or ``eager`` (written
out, the reference). :func:`attention` serves GPT-2's, BERT's and the Hugging Face
decoders' modules through transformers' attention interface; a :class:`Pattern` passed as
the mask says causal or not and the Seq1F1B offset. docs/training.md, "Attention and long
sequences", says more."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeflow.device_paths import cuda_path

MODES = ("sdpa", "eager")
IMPLEMENTATION = "pipeflow"  # the name under which attend() is registered with transformers


@dataclass(frozen=True)
class Pattern:
    """What one attention call computes: ``mode`` (sdpa | eager), causal or bidirectional,
    and ``offset``, the keys of earlier segments ahead of the call's own (Seq1F1B)."""

    mode: str = "sdpa"
    causal: bool = True
    offset: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"model.attention={self.mode}: allowed values: {', '.join(MODES)}")
        if self.offset and not self.causal:
            raise ValueError("a bidirectional attention call has no earlier segments (offset must be 0)")


def check_mode(mode) -> str:
    """``model.attention`` checked, with the project's message."""
    if mode not in MODES:
        raise ValueError(f"model.attention={mode}: allowed values: {', '.join(MODES)}")
    return str(mode)


def allowed(queries: int, keys: int, offset: int, window: int | None, device) -> Tensor:
    """[queries, keys] booleans: key ``j`` is seen by query ``t`` after ``offset`` earlier keys
    when ``j <= offset + t`` (lower-right causal) and ``j > offset + t - window``."""
    q = torch.arange(offset, offset + queries, device=device)[:, None]
    k = torch.arange(keys, device=device)[None, :]
    ok = k <= q
    if window:
        ok &= k > q - window
    return ok


def _additive(ok: Tensor, dtype: torch.dtype) -> Tensor:
    zero = torch.zeros((), dtype=dtype, device=ok.device)
    return torch.where(ok, zero, torch.finfo(dtype).min)


def _needs_mask(pattern: Pattern, queries: int, keys: int, window: int | None) -> bool:
    if not pattern.causal:
        return False
    if keys != queries + pattern.offset:
        raise ValueError(f"attention over {keys} keys for {queries} queries after {pattern.offset} earlier ones")
    return pattern.offset > 0 or bool(window and window < queries)


class _MaskedFlashCPU(torch.autograd.Function):
    """torch's CPU flash kernel with a mask, keeping for the backward what the kernel keeps
    but not the ``T x P`` mask, which the backward rebuilds."""

    @staticmethod
    def forward(ctx, q, k, v, offset: int, window, scale):
        mask = _additive(allowed(q.shape[2], k.shape[2], offset, window, q.device), q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.offset, ctx.window, ctx.scale = offset, window, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        mask = _additive(allowed(q.shape[2], k.shape[2], ctx.offset, ctx.window, q.device), q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def _kernel_inputs(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q, K and V in the dtype the kernel computes in (autocast's, under autocast on their
    device), cast by hand for calls that bypass autocast's dispatch: our CPU kernel and
    torch's lower-right causal bias, which checks that the three share a dtype."""
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _fused(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern, window: int | None, dropout: float,
           scale: float | None) -> Tensor:
    T, P = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    cuda = cuda_path("attention", q.device)  # CUDA's branches (on CPU too where asked: pipeflow.device_paths)
    device = q.device.type
    half = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype) in (
        torch.float16, torch.bfloat16)  # what the kernel computes in
    if not _needs_mask(pattern, T, P, window):
        if gqa and cuda and not half:
            # torch's one fused CUDA kernel at fp32 (memory-efficient attention) takes no
            # grouped-query attention: asked for it, SDPA falls back to its math path,
            # which keeps every s x s score (measured on an H100: llama_tiny at 2k tokens
            # held 2157 MiB where the fused kernel needs 430). Repeated heads keep it fused.
            # At 16 bits flash attention takes the groups (a rotary model's Q is fp32
            # here, autocast casts it: the kernel's dtype decides, not Q's)
            k, v, gqa = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1]), False
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=pattern.causal, scale=scale,
                                              enable_gqa=gqa)
    q, k, v = _kernel_inputs(q, k, v)
    if not cuda and dropout == 0.0:
        return _MaskedFlashCPU.apply(q, k, v, pattern.offset, window, scale)
    if not window and cuda:
        # torch's lower-right causal bias: flash attention at 16 bits (which takes
        # grouped-query attention), memory-efficient attention at fp32 (which does not)
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(T, P)
        if gqa and not half:
            k, v, gqa = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1]), False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale,
                                              enable_gqa=gqa)
    mask = allowed(T, P, pattern.offset, window, q.device)
    if gqa:  # torch's kernels that take a mask take as many key/value heads as query heads
        k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)


def _repeat_heads(t: Tensor, heads: int) -> Tensor:
    """Grouped-query attention's key/value heads repeated to ``heads`` (transformers' repeat_kv)."""
    b, kv, s, d = t.shape
    if kv == heads:
        return t
    return t[:, :, None].expand(b, kv, heads // kv, s, d).reshape(b, heads, s, d)


def _eager(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern, window: int | None, dropout: float,
           scale: float | None, training: bool) -> Tensor:
    T, P = q.shape[2], k.shape[2]
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    w = torch.matmul(q, k.transpose(-1, -2)) * scale
    if pattern.causal:
        w = w + _additive(allowed(T, P, pattern.offset, window, q.device), w.dtype)
    w = F.softmax(w, dim=-1).type(v.dtype)
    w = F.dropout(w, p=dropout, training=training)
    return torch.matmul(w, v)


def attention(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern, *, window: int | None = None,
              dropout: float = 0.0, scale: float | None = None, training: bool = True) -> Tensor:
    """Attention of ``q`` [B, h, T, d] over ``k``, ``v`` [B, kv, P, d] (kv divides h) as
    ``pattern`` says; returns [B, h, T, d]. ``dropout`` applies when ``training``."""
    dropout = dropout if training else 0.0
    if pattern.mode == "eager":
        return _eager(q, k, v, pattern, window, dropout, scale, training)
    return _fused(q, k, v, pattern, window, dropout, scale)


def attend(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
           scaling: float | None = None, sliding_window: int | None = None, **kwargs):
    """transformers' attention-interface signature: ``attention_mask`` is pipeflow's
    :class:`Pattern`; returns ([B, T, h, d], None) as transformers' own functions do."""
    if not isinstance(attention_mask, Pattern):
        raise TypeError(f"{type(module).__name__}: pipeflow's attention takes a Pattern as attention_mask, "
                        f"not {type(attention_mask).__name__} (build the stage with pipeflow.models)")
    out = attention(query, key, value, attention_mask, window=sliding_window, dropout=dropout, scale=scaling,
                    training=module.training)
    return out.transpose(1, 2), None


class SegmentCache:
    """The key/value cache a decoder layer sees on a Seq1F1B segment: ``update`` returns the
    earlier segments' keys and values (``past``: one tensor each, or one per segment) with
    this segment's appended, and records this segment's own (the first record stands)."""

    def __init__(self, past):
        self.past = None if past is None else tuple(_parts(t) for t in past)
        self.own: tuple[Tensor, Tensor] | None = None

    def update(self, keys: Tensor, values: Tensor, layer_idx: int = 0, *args, **kwargs):
        if self.own is None:
            self.own = (keys, values)
        if self.past is None:
            return keys, values
        return torch.cat([*self.past[0], keys], 2), torch.cat([*self.past[1], values], 2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.past is None else sum(t.shape[2] for t in self.past[0])


def _parts(t) -> tuple[Tensor, ...]:
    return (t,) if isinstance(t, Tensor) else tuple(t)


def register() -> None:
    """Make :data:`IMPLEMENTATION` a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, attend)


register()
