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
import torch
from torch import Tensor

from . import _ops, _options
from ._options import ALIGN, ARRAY_OPTIONS, FIELDS, KEPT, LAYOUT, NAMES, SOFTCAP, WINDOW

__all__ = ["scaled_dot_product_attention", "flash_attn_func"]

# The operators' schemas come from the option tables of qkv/_options.py: the tensors first (q, k,
# v, then each array option, optional, in ARRAY_OPTIONS' order), then every scalar option as a
# keyword-only argument with its default. An option added to the tables is one more optional
# tensor after the last one or one more keyword: no existing argument moves, and a call or a saved
# graph that does not name it keeps its meaning. The autograd formula returns one gradient per
# tensor argument: q, k, v, and for each array option its gradient or None (ARRAY_OPTIONS says).
_ARRAY_NAMES = tuple(name for name, _ in ARRAY_OPTIONS)
_DEFAULTS = {name: default for name, _, default in FIELDS}


def _schema_default(x):
    return f'"{x}"' if isinstance(x, str) else str(x)


_ARRAY_ARGS = "".join(f", Tensor? {name}=None" for name in _ARRAY_NAMES)
_FIELD_ARGS = ", ".join(f"{kind} {name}={_schema_default(default)}" for name, kind, default in FIELDS)
_GRADS = ", ".join(["Tensor"] * (3 + sum(grad for _, grad in ARRAY_OPTIONS)))
_FORWARD_SCHEMA = f"(Tensor q, Tensor k, Tensor v{_ARRAY_ARGS}, *, {_FIELD_ARGS}) -> (Tensor, Tensor)"
_BACKWARD_SCHEMA = (f"(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse{_ARRAY_ARGS}, "
                    f"*, {_FIELD_ARGS}) -> ({_GRADS})")


def _key(kwargs):
    """The options key of an operator's keyword arguments (the dispatcher may leave out defaults)."""
    return tuple(kwargs.get(name, default) for name, default in _DEFAULTS.items())


def _padded(arrays):
    """The array options of an operator call, one per ARRAY_OPTIONS (trailing defaults may be absent)."""
    return arrays + (None,) * (len(_ARRAY_NAMES) - len(arrays))


def _input_grads(grads, arrays):
    """The gradients of the tensor arguments, from the backward's (dq, dk, dv, then one per array
    option that gets a gradient, where that array was given): None for the others."""
    rest = iter(grads[3:])
    return (*grads[:3], *(next(rest, None) if grad and x is not None else None
                          for (_, grad), x in zip(ARRAY_OPTIONS, _padded(tuple(arrays)))))


_KERNEL = NAMES.index("kernel_name")


def _backward_key(key):
    """The options of a forward's backward: the decode kernel has no backward, and every other
    gives the same gradients, so a forward forced onto it runs its backward on the automatic one."""
    return key if key[_KERNEL] != "decode" else tuple("auto" if i == _KERNEL else x for i, x in enumerate(key))


def _attention_impl(q, k, v, *arrays, **kwargs):
    key = _key(kwargs)
    out, lse, _ = _ops._forward(q, k, v, "torch", _padded(arrays), KEPT.get(key) or _options.options(key), True, False)
    return out, lse


_attention_op = torch.library.custom_op("qkv::attention", _attention_impl, mutates_args=(), device_types="cpu",
                                        schema=_FORWARD_SCHEMA)


@_attention_op.register_fake
def _attention_fake(q, k, v, *arrays, **kwargs):
    if kwargs.get("layout", "bhsd") == "bshd":
        B, Sq, Hq, _ = q.shape
        out = q.new_empty((B, Sq, Hq, v.shape[-1]))
    else:
        B, Hq, Sq, _ = q.shape
        out = q.new_empty((B, Hq, Sq, v.shape[-1]))
    lse = q.new_empty((B, Hq, Sq), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    return out, lse


def _no_dsinks(q):
    # the backward operator's dsinks output where no sinks are given: an empty float32 tensor
    return q.new_empty((0,), dtype=torch.float32)


def _attention_backward_impl(grad_out, q, k, v, out, softmax_lse, *arrays, **kwargs):
    key = _key(kwargs)
    grads = _ops._backward(q, k, v, out, softmax_lse, grad_out, "torch", _padded(arrays),
                           KEPT.get(key) or _options.options(key))
    return grads if len(grads) == 4 else (*grads, _no_dsinks(q))


_attention_backward_op = torch.library.custom_op("qkv::attention_backward", _attention_backward_impl, mutates_args=(),
                                                 device_types="cpu", schema=_BACKWARD_SCHEMA)


@_attention_backward_op.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, softmax_lse, *arrays, **kwargs):
    sinks = _padded(arrays)[_ops.SINKS]
    dsinks = _no_dsinks(q) if sinks is None else sinks.new_empty(sinks.shape, dtype=torch.float32)
    return (*(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)), dsinks)


def _contiguous_rows(grad_out):
    # e.g. the expanded gradient of a .sum(): the kernel needs a contiguous last dimension
    return grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs, *output)
    ctx.fields = keyword_only_inputs


def _backward(ctx, grad_out, grad_lse):
    # softmax_lse is returned for inspection (as FlashAttention's); its gradient is not propagated.
    q, k, v, *arrays, out, lse = ctx.saved_tensors
    fields = dict(zip(NAMES, _backward_key(_key(ctx.fields))))
    return _input_grads(_attention_backward_op(_contiguous_rows(grad_out), q, k, v, out, lse, *arrays, **fields),
                        arrays)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


class _Attention(torch.autograd.Function):
    """qkv.attention under eager autograd: the operators' forward and backward without the
    dispatcher's Python layers (which cost tens of microseconds a call, most of it in filling in
    the schema's defaults). apply(q, k, v, *arrays (ARRAY_OPTIONS' order), options key); the
    graph keeps the key, not the Options (the extension's objects are all gone at exit)."""

    @staticmethod
    def forward(ctx, q, k, v, *rest):
        arrays, key = rest[:-1], rest[-1]
        out, lse, _ = _ops._forward(q, k, v, "torch", arrays, KEPT.get(key) or _options.options(key), True, False)
        ctx.save_for_backward(q, k, v, out, lse, *arrays)
        ctx.key = key
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, *arrays = ctx.saved_tensors
        key = _backward_key(ctx.key)
        grads = _ops._backward(q, k, v, out, lse, _contiguous_rows(grad_out), "torch", tuple(arrays),
                               KEPT.get(key) or _options.options(key))
        return (*_input_grads(grads, arrays)[:3 + len(arrays)], None)  # None: the options key


def _differentiable(q, k, v, arrays, key):
    """(out, softmax_lse) of checked tensors, arrays (ARRAY_OPTIONS' order) and an options key,
    recorded for autograd. torch.compile, torch.func transforms, dispatch modes (FakeTensor,
    make_fx) and tensor subclasses see the custom operator; plain eager autograd runs _Attention."""
    if torch.compiler.is_compiling() or type(q) not in (Tensor, torch.nn.Parameter) or \
            torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack():
        return _attention_op(q, k, v, *arrays, **dict(zip(NAMES, key)))
    return _Attention.apply(q, k, v, *arrays, key)


_ops._differentiable = _differentiable


def _call(q, k, v, names, mask=None, scale=None, causal=False, align=ALIGN, window=WINDOW, softcap=SOFTCAP,
          layout=LAYOUT, sinks=None, alibi_slopes=None, keep_first=0):
    """(out, softmax_lse) of the drop-in functions' arguments (names: their names of the options)."""
    if _ops._tensors(q, k, v) != "torch":
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__module__}.{type(q).__name__}")
    key = _options.values(scale, causal, align, window, softcap, layout, keep_first=keep_first, names=names)
    _ops._ranks(q, k, v, layout)
    arrays = _ops.arrays("torch", mask, None, sinks, alibi_slopes, names=names, differentiable=True)
    out, lse, _ = _ops._run(q, k, v, "torch", arrays, key, True, False)
    return out, lse


_SDPA_NAMES = {"causal": "is_causal", "mask": "attn_mask"}
_FLASH_NAMES = {"scale": "softmax_scale", "window": "window_size"}


@_options.keyword_only
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, sinks=None, alibi_slopes=None, **unknown):
    """torch.nn.functional.scaled_dot_product_attention on qkv's kernels (forward and backward).

    Semantics are PyTorch's: query [B, Hq, L, E], key [B, Hkv, S, E], value [B, Hkv, S, Ev]
    (BHSD; a 3-D [N, L, E] call is one head), is_causal is top-left aligned (query i sees keys
    0..i), attn_mask is bool (True = attend) or float (added to the scores), broadcastable to
    [B, Hq, L, S]; Hq != Hkv requires enable_gqa=True; scale defaults to 1/sqrt(E). A query row
    with no admissible key gives zeros (as PyTorch 2.13). A float attn_mask of the query's
    dtype, bfloat16 or float16 (as PyTorch allows), is converted to float32, exactly: a copy of
    the mask's size, never of q, k or v.

    qkv's extensions, keyword-only (qkv.attention's options of the same names): sinks, [Hq]
    attention-sink logits (gpt-oss; differentiable), and alibi_slopes, [Hq] or [B, Hq] float32
    ALiBi slopes (no gradient), whose |i - j| distance is top-left aligned like is_causal (query
    i sits at key i). SDPA has no sliding window, so keep_first has no place here.

    Raises: NotImplementedError for dropout_p > 0 and for an attn_mask or alibi_slopes that
    requires grad (qkv computes no gradient for them); ValueError for is_causal with attn_mask (as PyTorch), Hq != Hkv
    without enable_gqa, and everything qkv.attention refuses; TypeError for an enable_gqa that
    is not a bool (or 0/1), and for a keyword this function does not take (naming it, and the one
    meant for a misspelling).
    """
    if unknown:
        _options.misuse(scaled_dot_product_attention, (), unknown)
    if dropout_p > 0.0:
        raise NotImplementedError(f"dropout_p: qkv does not implement attention dropout, got dropout_p = {dropout_p}")
    enable_gqa = _options._flag("enable_gqa", enable_gqa)  # a bool, as PyTorch requires ("no" is not False)
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
    out, _ = _call(query, key, value, _SDPA_NAMES, mask=attn_mask, scale=scale, causal=is_causal, align="top-left",
                   sinks=sinks, alibi_slopes=alibi_slopes)
    return out.squeeze(1) if squeeze else out


@_options.keyword_only
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=WINDOW, softcap=SOFTCAP,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, sinks=None, keep_first=0,
                    **unknown):
    """FlashAttention's flash_attn_func on qkv's kernels (forward and backward).

    Semantics are FlashAttention 2's: q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv]
    (BSHD), Hq % Hkv == 0 (MQA/GQA), causal and window_size aligned bottom-right (the last query
    sees the last key), softcap > 0 caps the scores, softmax_scale defaults to 1/sqrt(D),
    alibi_slopes float32 [Hq] or [B, Hq] adds -slope * |i + Sk - Sq - j| to the scores (no
    gradient; FlashAttention's causal kernel adds slope * j instead, which gives the same out and
    gradients but a softmax_lse lower by slope * (i + Sk - Sq) in each row).
    qkv's backward is always deterministic, so `deterministic` changes nothing. qkv's extensions,
    keyword-only: sinks, [Hq] attention-sink logits (gpt-oss; differentiable), and keep_first,
    keys 0 .. keep_first-1 seen by every query besides window_size (StreamingLLM), as
    qkv.attention.

    Returns out [B, Sq, Hq, Dv]; with return_attn_probs=True the tuple (out, softmax_lse,
    S_dmask), where softmax_lse [B, Hq, Sq] float32 is the natural log of each row's sum of
    exp(score), and S_dmask is None: FlashAttention returns the dropout mask pattern there only
    for dropout_p > 0, which qkv does not implement. A query row with no admissible key (a
    window or Sk = 0) has output 0 and softmax_lse -inf, the log of its empty sum (FlashAttention
    2's CUDA kernel writes +inf there), or z_h with sinks.

    Raises: NotImplementedError for dropout_p > 0 (naming the argument) or alibi_slopes that
    require grad with grad enabled; ValueError/TypeError as qkv.attention; TypeError for a keyword
    this function does not take.
    """
    if unknown:
        _options.misuse(flash_attn_func, (), unknown)
    if dropout_p > 0.0:
        raise NotImplementedError(f"dropout_p: qkv does not implement attention dropout, got dropout_p = {dropout_p}")
    out, lse = _call(q, k, v, _FLASH_NAMES, scale=softmax_scale, causal=causal, window=window_size, softcap=softcap,
                     layout="bshd", sinks=sinks, alibi_slopes=alibi_slopes, keep_first=keep_first)
    if return_attn_probs:
        return out, lse, None
    return out
