"""qkv in PyTorch: differentiable custom operators and drop-in attention functions.

- torch.ops.qkv.attention / torch.ops.qkv.attention_backward: custom operators
  (torch.library.custom_op) with fake (meta) implementations and an autograd formula, so qkv
  attention runs under autograd and inside torch.compile(fullgraph=True) without a graph break.
- scaled_dot_product_attention: torch.nn.functional.scaled_dot_product_attention's signature and
  semantics (BHSD, top-left causal, bool mask True = attend, enable_gqa).
- flash_attn_func: FlashAttention's flash_attn_func (BSHD, bottom-right causal, natural-log
  softmax_lse).

Tensors must be on the CPU; they are passed to the C++ library without a copy.
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _ops, _qkv

__all__ = ["scaled_dot_product_attention", "flash_attn_func"]


def _run_forward(q, k, v, mask, kv_lens, scale, causal, top_left, window_left, window_right, softcap, bshd,
                 kernel, num_threads):
    out, lse, _ = _ops._forward(q, k, v, "torch", bshd, scale, causal, "top-left" if top_left else "bottom-right",
                                window_left, window_right, softcap,
                                None if mask is None else mask.detach(),
                                None if kv_lens is None else kv_lens.detach(), kernel, num_threads, True, False)
    return out, lse


@torch.library.custom_op("qkv::attention", mutates_args=(), device_types="cpu")
def _attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], kv_lens: Optional[Tensor],
                  scale: float, causal: bool, top_left: bool, window_left: int, window_right: int,
                  softcap: float, bshd: bool, kernel: str, num_threads: int) -> Tuple[Tensor, Tensor]:
    """qkv.attention as an operator: returns (out, softmax_lse)."""
    return _run_forward(q, k, v, mask, kv_lens, scale, causal, top_left, window_left, window_right, softcap,
                        bshd, kernel, num_threads)


@_attention_op.register_fake
def _attention_fake(q, k, v, mask, kv_lens, scale, causal, top_left, window_left, window_right, softcap, bshd,
                    kernel, num_threads):
    if bshd:
        B, Sq, Hq, _ = q.shape
        out = q.new_empty((B, Sq, Hq, v.shape[-1]))
    else:
        B, Hq, Sq, _ = q.shape
        out = q.new_empty((B, Hq, Sq, v.shape[-1]))
    lse = q.new_empty((B, Hq, Sq), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    return out, lse


@torch.library.custom_op("qkv::attention_backward", mutates_args=(), device_types="cpu")
def _attention_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           mask: Optional[Tensor], kv_lens: Optional[Tensor], scale: float, causal: bool,
                           top_left: bool, window_left: int, window_right: int, softcap: float, bshd: bool,
                           kernel: str, num_threads: int) -> Tuple[Tensor, Tensor, Tensor]:
    """qkv.attention_backward as an operator: returns (dq, dk, dv) in q's dtype."""
    if kernel == "decode":
        kernel = "auto"  # the decode kernel has no backward; any other gives the same gradients
    return _ops.attention_backward(q, k, v, out, lse, grad_out, scale=scale, causal=causal,
                                   align="top-left" if top_left else "bottom-right",
                                   window=(window_left, window_right), softcap=softcap, mask=mask,
                                   kv_lens=kv_lens, layout="bshd" if bshd else "bhsd", kernel=kernel,
                                   num_threads=num_threads)


@_attention_backward_op.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, mask, kv_lens, scale, causal, top_left, window_left,
                             window_right, softcap, bshd, kernel, num_threads):
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format), \
        torch.empty_like(v, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, kv_lens, *opts = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, kv_lens)
    ctx.opts = opts


def _backward(ctx, grad_out, grad_lse):
    # softmax_lse is returned for inspection (as FlashAttention's); its gradient is not propagated.
    q, k, v, out, lse, mask, kv_lens = ctx.saved_tensors
    if grad_out.stride(-1) != 1:  # e.g. the expanded gradient of a .sum(): the kernel needs stride 1
        grad_out = grad_out.contiguous()
    dq, dk, dv = _attention_backward_op(grad_out, q, k, v, out, lse, mask, kv_lens, *ctx.opts)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _attention(q, k, v, *, mask=None, kv_lens=None, scale=None, causal=False, top_left=False, window=(-1, -1),
               softcap=0.0, bshd=False, kernel="auto", num_threads=0, names=("scale", "causal", "window", "mask")):
    """Differentiable attention through the custom operator; returns (out, softmax_lse). names:
    the caller's names of scale, causal, window and mask, for the error messages."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _ops._framework(name, x)
        _ops._check_rank4(name, x, "[B,S,H,D]" if bshd else "[B,H,S,D]")
    _ops._check_float("q", q, "torch")
    _ops._same("k", k, "torch", q)
    _ops._same("v", v, "torch", q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else _ops._real(names[0], scale)
    causal = _ops._flag(names[1], causal)
    wl, wr = _ops._window(window, names[2])
    return _attention_op(q, k, v, _ops._aux(names[3], mask, "torch", refuse_grad=True),
                         _ops._aux("kv_lens", kv_lens, "torch"), scale, causal, bool(top_left), wl, wr,
                         _ops._real("softcap", softcap), bool(bshd), kernel, int(num_threads))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention on qkv's kernels (forward and backward).

    Semantics are PyTorch's: query [B, Hq, L, E], key [B, Hkv, S, E], value [B, Hkv, S, Ev]
    (BHSD; a 3-D [N, L, E] call is one head), is_causal is top-left aligned (query i sees keys
    0..i), attn_mask is bool (True = attend) or float (added to the scores), broadcastable to
    [B, Hq, L, S]; Hq != Hkv requires enable_gqa=True; scale defaults to 1/sqrt(E). A query row
    with no admissible key gives zeros (as PyTorch 2.13). A float attn_mask of the query's
    dtype, bfloat16 or float16 (as PyTorch allows), is converted to float32, exactly: a copy of
    the mask's size, never of q, k or v.

    Raises: NotImplementedError for dropout_p > 0 and for an attn_mask that requires grad (qkv
    computes no mask gradient); ValueError for is_causal with attn_mask (as PyTorch), Hq != Hkv
    without enable_gqa, and everything qkv.attention refuses.
    """
    if dropout_p > 0.0:
        raise NotImplementedError(f"dropout_p: qkv does not implement attention dropout, got dropout_p = {dropout_p}")
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask: expected None with is_causal=True (as PyTorch), got a mask")
    if isinstance(attn_mask, Tensor) and attn_mask.dtype in (torch.bfloat16, torch.float16) and \
            attn_mask.dtype == getattr(query, "dtype", None):
        attn_mask = attn_mask.float() if not attn_mask.requires_grad else attn_mask  # refused below by name
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)
    if query.dim() == 4 and key.dim() == 4 and query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"key: expected num_kv_heads == num_heads ({query.shape[1]}) without enable_gqa=True, "
                         f"got {key.shape[1]}")
    out, _ = _attention(query, key, value, mask=attn_mask, scale=scale, causal=is_causal, top_left=True,
                        names=("scale", "is_causal", "window", "attn_mask"))
    return out.squeeze(1) if squeeze else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention's flash_attn_func on qkv's kernels (forward and backward).

    Semantics are FlashAttention 2's: q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv]
    (BSHD), Hq % Hkv == 0 (MQA/GQA), causal and window_size aligned bottom-right (the last query
    sees the last key), softcap > 0 caps the scores, softmax_scale defaults to 1/sqrt(D).
    qkv's backward is always deterministic, so `deterministic` changes nothing.

    Returns out [B, Sq, Hq, Dv]; with return_attn_probs=True the tuple (out, softmax_lse,
    S_dmask), where softmax_lse [B, Hq, Sq] float32 is the natural log of each row's sum of
    exp(score), and S_dmask is None: FlashAttention returns the dropout mask pattern there only
    for dropout_p > 0, which qkv does not implement. A query row with no admissible key (a
    window or Sk = 0) has output 0 and softmax_lse -inf, the log of its empty sum (FlashAttention
    2's CUDA kernel writes +inf there).

    Raises: NotImplementedError for dropout_p > 0 or alibi_slopes given (naming the argument);
    ValueError/TypeError as qkv.attention.
    """
    if dropout_p > 0.0:
        raise NotImplementedError(f"dropout_p: qkv does not implement attention dropout, got dropout_p = {dropout_p}")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: qkv does not implement ALiBi biases (pass an additive mask to "
                                  "qkv.attention instead)")
    out, lse = _attention(q, k, v, scale=softmax_scale, causal=causal, window=window_size, softcap=softcap, bshd=True,
                          names=("softmax_scale", "causal", "window_size", "mask"))
    if return_attn_probs:
        return out, lse, None
    return out
