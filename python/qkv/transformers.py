"""qkv as an attention implementation of Hugging Face transformers.

    import qkv.transformers
    qkv.transformers.register()                      # the name "qkv"
    model = AutoModel.from_pretrained(path, attn_implementation="qkv")

register() adds two functions to transformers' registries: `attention_forward` to
`AttentionInterface` (what each attention layer calls) and `mask` to `AttentionMaskInterface`
(what the model calls once per forward to build the mask its layers share). The mask function
recognises transformers' own mask patterns (causal, bidirectional, sliding window, each with a
2-D padding mask) and returns a `Mask`: the qkv options that give the same attention (causal,
align, window, kv_lens, or a [B, 1, 1, Sk] key mask), shown to transformers as a one-element
[B, 1, Sq, Sk] bool tensor, never a dense mask (its values are made only if something other than
qkv's attention reads them). Any
other pattern (packed sequences, chunked attention, image-token overlays, a custom mask
function) gets transformers' dense boolean mask, which qkv takes as its `mask`. Which case each
model family hits: docs/python.md ("Hugging Face transformers").

The attention function takes q, k, v as transformers hands them ([B, H, S, D] views of
[B, S, H, D] projections) with their strides, GQA directly (Hq != Hkv, no repeat_kv), and returns
the output [B, Sq, Hq, Dv] contiguous, computed by qkv.attention in the "bshd" layout; under
autograd the gradients are qkv's backward (qkv.torch).

Source: transformers' attention and mask interfaces (transformers.modeling_utils.AttentionInterface,
transformers.masking_utils: sdpa_attention_forward, sdpa_mask and the mask functions), whose
semantics these functions reproduce; the kernels are qkv.attention's (FlashAttention-2, Dao 2023).
"""

import torch
import transformers
from transformers import masking_utils as _mu

import qkv
from . import _ops, _options

__all__ = ["register", "attention_forward", "mask", "Mask"]


# The code objects of transformers' mask-function factories, to recognise the closures they return.
_AND = _mu.and_masks(_mu.causal_mask_function).__code__
_SLIDING = _mu.sliding_window_overlay(1).__code__
_SLIDING_BIDIRECTIONAL = _mu.sliding_window_bidirectional_overlay(1).__code__


# Tensor functions that read a Mask's metadata; every other one sees its dense values.
_METADATA = {torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__, torch.Tensor.dtype.__get__,
             torch.Tensor.device.__get__, torch.Tensor.is_cpu.__get__, torch.Tensor.requires_grad.__get__,
             torch.Tensor.dim, torch.Tensor.size, torch.Tensor.__len__}


class Mask(torch.Tensor):
    """The attention mask of one forward, as qkv options (what `mask` returns instead of a dense mask).

    A bool tensor of shape [B, 1, Sq, Sk] (True = attend) to transformers, which passes a 4-D mask
    on as it is (generate() with a static cache builds the masks ahead and hands them back to the
    model); its storage is one element. Reading its shape, ndim, dtype or device costs nothing;
    any other tensor operation (someone else's attention, slicing, printing the values) gets the
    dense mask of transformers' sdpa_mask, made on first use, so the object never means anything
    but that mask.

    Attributes:
      q_length, kv_length: the Sq and Sk it was made for (the attention function checks them).
      keys: how many leading keys are read (kv_length, or fewer for a static cache, whose slots
        past the last written token are never visible to a causal query).
      options: the keyword arguments of qkv.attention: causal, align, window, and kv_lens (int64
        [B]) or mask (bool [B, 1, 1, keys], True = attend) where a padding mask excludes keys.
    """

    @staticmethod
    def __new__(cls, dense_args, q_length, kv_length, keys, options):
        base = torch.ones((), dtype=torch.bool).expand(dense_args["batch_size"], 1, q_length, kv_length)
        self = torch.Tensor._make_subclass(cls, base)
        self.q_length, self.kv_length, self.keys, self.options = q_length, kv_length, keys, options
        self._dense_args, self._dense = dense_args, None
        # what each layer's call passes on: the array options, and the checked options key per
        # (scale, softcap), made once per forward rather than once per layer
        self._arrays = _ops.arrays("torch", options.get("mask"), options.get("kv_lens"))
        self._keys = {}
        return self

    def _key(self, scale, softcap):
        key = self._keys.get((scale, softcap))
        if key is None:
            o = self.options
            key = self._keys[(scale, softcap)] = _options.values(scale, o["causal"], o["align"], o["window"],
                                                                  float(softcap) if softcap else 0.0, "bshd")
        return key

    def dense(self):
        """The dense bool mask [B, 1, Sq, Sk] (True = attend) of transformers' sdpa_mask."""
        if self._dense is None:
            self._dense = _mu.sdpa_mask(**self._dense_args, allow_is_causal_skip=False)
        return self._dense

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.contiguous and len(args) == 1 and not kwargs:
            return args[0]  # generate() makes its masks contiguous: this one stays a description
        args, kwargs = torch.utils._pytree.tree_map(lambda x: x.dense() if isinstance(x, Mask) else x,
                                                    (args, kwargs))
        return func(*args, **kwargs)

    def __repr__(self, **_):
        shown = {k: (f"tensor{list(v.shape)}" if isinstance(v, torch.Tensor) else v) for k, v in self.options.items()}
        return f"qkv.transformers.Mask(q_length={self.q_length}, kv_length={self.kv_length}, keys={self.keys}, {shown})"


def _closure(fn, name):
    code = fn.__code__
    return fn.__closure__[code.co_freevars.index(name)].cell_contents if name in code.co_freevars else None


def _pattern(fn):
    """(causal, sliding_window or None) of transformers' own mask functions, None for any other."""
    if fn is _mu.causal_mask_function:
        return True, None
    if fn is _mu.bidirectional_mask_function:
        return False, None
    if getattr(fn, "__code__", None) is not _AND:
        return None
    parts = _closure(fn, "mask_functions")
    if not (isinstance(parts, tuple) and len(parts) == 2):
        return None
    overlay, base = parts
    code = getattr(overlay, "__code__", None)
    window = _closure(overlay, "sliding_window") if code in (_SLIDING, _SLIDING_BIDIRECTIONAL) else None
    if type(window) is not int or window < 1:
        return None
    if code is _SLIDING and base is _mu.causal_mask_function:
        return True, window
    if code is _SLIDING_BIDIRECTIONAL and base is _mu.bidirectional_mask_function:
        return False, window
    return None


def _describe(pattern, q_length, kv_length, q_offset, kv_offset, attention_mask, dense_args):
    """The Mask of a recognised pattern, or None where qkv's options cannot express it.

    Query i sits at position q_offset + i, key j at kv_offset + j; transformers' causal rule
    kv_pos <= q_pos is j <= i + d with d = q_offset - kv_offset, its sliding window
    kv_pos > q_pos - W (W counts the query itself) is j >= i + d - (W - 1): qkv's window
    (W - 1, 0) around the diagonal i + d, which is qkv's bottom-right diagonal when
    d = Sk - Sq (a KV cache, chunked prefill) and its top-left one when d = 0.
    """
    causal, sliding = pattern
    d = int(q_offset) - int(kv_offset)
    keys = kv_length
    if d == 0:
        align = "top-left"
    elif d == kv_length - q_length:
        align = "bottom-right"
    elif causal and 0 < d < kv_length - q_length:
        # a static cache: keys past d + Sq - 1 are unwritten slots no causal query sees
        keys, align = d + q_length, "bottom-right"
    else:
        return None
    if causal:
        window = (sliding - 1, 0) if sliding else (-1, -1)
    else:
        window = (sliding, sliding) if sliding else (-1, -1)
    options = {"causal": causal, "align": align, "window": window}
    if attention_mask is not None:
        pad = _mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        pad = pad[:, int(kv_offset):int(kv_offset) + keys]
        if pad.shape[-1] != keys:
            return None
        if not bool(pad.all()):
            lens = pad.sum(-1)
            prefix = bool((pad == (torch.arange(keys, device=pad.device) < lens[:, None])).all())
            # kv_lens moves qkv's bottom-right diagonal with each length: it keeps transformers'
            # meaning only with the top-left diagonal or where no diagonal matters
            if prefix and (align == "top-left" or (not causal and window == (-1, -1))):
                options["kv_lens"] = lens.to(torch.int64)
            else:
                options["mask"] = pad[:, None, None, :]
    return Mask(dense_args, q_length, kv_length, keys, options)


def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=_mu.causal_mask_function,
         attention_mask=None, local_size=None, allow_is_causal_skip=True, allow_is_bidirectional_skip=False,
         use_vmap=False, device="cpu", **kwargs):
    """transformers' mask interface for qkv (the arguments of transformers.masking_utils.sdpa_mask).

    Returns a `Mask` (qkv options, no dense mask) for transformers' causal, bidirectional and
    sliding-window mask functions with or without a 2-D padding mask (attention_mask [B, >= kv_offset +
    kv_length], True = token), whenever the query and key positions fit one of qkv's diagonals;
    otherwise (any other mask function, or under tracing) the dense bool mask [B, 1, Sq, Sk] of
    sdpa_mask, True = attend.
    """
    dense_args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                      kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                      local_size=local_size, allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device)
    pattern = _pattern(mask_function)
    tracing = attention_mask is not None and _mu.is_tracing(attention_mask)
    if pattern is not None and not tracing and not (isinstance(q_offset, torch.Tensor) and _mu.is_tracing(q_offset)):
        described = _describe(pattern, q_length, kv_length, q_offset, kv_offset, attention_mask, dense_args)
        if described is not None:
            return described
    return _mu.sdpa_mask(**dense_args, allow_is_causal_skip=False)


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      softcap=None, s_aux=None, is_causal=None, **kwargs):
    """transformers' attention interface for qkv.

    Args (as transformers' sdpa_attention_forward):
      query [B, Hq, Sq, D], key [B, Hkv, Sk, D], value [B, Hkv, Sk, Dv] (Hq % Hkv == 0; any
        strides with a contiguous last dimension), CPU tensors of one float dtype.
      attention_mask: a `Mask` (from `mask`), a bool (True = attend) or float (added) tensor
        broadcastable to [B, Hq, Sq, Sk], or None: causal (is_causal, else module.is_causal) with
        PyTorch's top-left diagonal when Sq > 1, as transformers' sdpa.
      scaling: the scale (None: 1/sqrt(D)); softcap: Gemma 2's score cap (None or 0: off).
      dropout: applied only while module.training; qkv has no attention dropout, so a dropout > 0
        there is an error (at eval transformers passes 0, and any value is ignored).
      sliding_window: ignored; the window is the mask's (transformers builds it per layer type).
      s_aux: gpt-oss's attention sinks [Hq], qkv's `sinks` (one more softmax term per row, no
        value); their gradient flows back to the model's parameter under autograd.

    Returns: (output [B, Sq, Hq, Dv] contiguous, None).

    Raises: NotImplementedError naming dropout (> 0 in training),
      position_bias; ValueError for output_attentions=True, tensors not on the CPU, a Mask made
      for other lengths; what qkv.attention raises.
    """
    if kwargs.get("output_attentions", False):
        raise ValueError("output_attentions: qkv does not return the attention weights; load the model with "
                         "attn_implementation='eager' to get them")
    if dropout and module.training:
        raise NotImplementedError(f"dropout: qkv does not implement attention dropout, got dropout = {dropout} in "
                                  "training; set the model's attention dropout to 0 (e.g. attention_dropout=0.0 or "
                                  "attention_probs_dropout_prob=0.0) or call model.eval()")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("position_bias: qkv does not take a relative position bias in transformers; use "
                                  "attn_implementation='sdpa' or 'eager'")
    if not (query.is_cpu and key.is_cpu and value.is_cpu):
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not x.is_cpu:
                raise ValueError(f"{name}: qkv computes on the CPU, got a tensor on device '{x.device}'")
    Sq, Sk = query.shape[2], key.shape[2]
    options = {}
    if isinstance(attention_mask, Mask):
        if attention_mask.q_length != Sq or attention_mask.kv_length != Sk:
            raise ValueError(f"attention_mask: a qkv Mask for Sq = {attention_mask.q_length}, Sk = "
                             f"{attention_mask.kv_length}, got query Sq = {Sq} and key Sk = {Sk}")
        if attention_mask.keys != Sk:
            key, value = key[:, :, :attention_mask.keys], value[:, :, :attention_mask.keys]
        if s_aux is None and query.ndim == 4 and key.ndim == 4 and value.ndim == 4:
            # the common path: the options checked once per forward (Mask._key), not once per layer
            q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
            _ops._tensors(q, k, v)
            return _ops._run(q, k, v, "torch", attention_mask._arrays, attention_mask._key(scaling, softcap),
                             False, False)[0], None
        options.update(attention_mask.options)
    elif attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        options.update(causal=bool(causal) and Sq > 1, align="top-left")
    else:
        if attention_mask.dtype not in (torch.bool, torch.float32, torch.float64):
            attention_mask = attention_mask.float()
        options["mask"] = attention_mask
    if softcap:
        options["softcap"] = float(softcap)
    if s_aux is not None:
        options["sinks"] = s_aux  # float16/bfloat16 widened exactly by qkv; float64 is a TypeError
    out = qkv.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale=scaling,
                        layout="bshd", **options)
    return out, None


def register(name="qkv"):
    """Registers qkv with transformers under `name`: attention_forward with AttentionInterface and
    mask with AttentionMaskInterface, so that attn_implementation=name (from_pretrained, from_config,
    model.set_attn_implementation) runs qkv. Returns name."""
    transformers.AttentionInterface.register(name, attention_forward)
    transformers.AttentionMaskInterface.register(name, mask)
    return name
