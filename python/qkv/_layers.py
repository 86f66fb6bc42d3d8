"""qkv.MultiHeadAttention and qkv.KVCache: the C++ layer and cache (qkv/mha.hpp, qkv/kv_cache.hpp)."""
import numpy as np

from . import _ops, _options, _qkv
from ._options import ALIGN, LAYOUT, SOFTCAP, WINDOW


def _as_f32_numpy(name, x):
    """A weight as a C-contiguous float32 NumPy array (weights are copied once, at load)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x, dtype=np.float32)
    torch = _ops._torch()
    if torch is not None and isinstance(x, torch.Tensor):
        return np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())
    raise TypeError(f"{name}: expected a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")


class KVCache:
    """The key/value cache of one attention layer for decoding (Pope et al. 2022).

    Storage K [B, Hkv, capacity, D], V [B, Hkv, capacity, Dv] in `dtype` ("float32", "float64",
    "bfloat16" or "float16"), plus a length per sequence. append() adds the newest tokens'
    k [B, Hkv, S, D] and v (any float dtype, layout "bhsd" or "bshd"); attend() runs attention of
    new queries over everything cached, bottom-right aligned, so causal=True after appending the
    queries' own tokens gives exactly full-sequence causal attention.
    Raises ValueError for mismatched shapes or an append beyond the capacity (nothing is written).
    """

    def __init__(self, batch, num_kv_heads, capacity, head_dim, dtype="float32", head_dim_v=0):
        self._c = _qkv._KVCache(batch, num_kv_heads, capacity, head_dim, dtype, head_dim_v)

    batch = property(lambda self: self._c.batch)
    num_kv_heads = property(lambda self: self._c.num_kv_heads)
    capacity = property(lambda self: self._c.capacity)
    head_dim = property(lambda self: self._c.head_dim)
    dtype = property(lambda self: self._c.dtype)
    lengths = property(lambda self: self._c.lengths, doc="Cached positions per sequence, [B].")
    max_length = property(lambda self: self._c.max_length)

    def append(self, k, v, *, layout=LAYOUT):
        fw = _ops._framework("k", k)
        _ops._framework("v", v)
        if fw == "torch":
            k, v = _ops._detach(k), _ops._detach(v)
        self._c.append(k, v, _ops._layout(layout))

    @_options.keyword_only
    def attend(self, q, *positional, causal=False, window=WINDOW, scale=None, softcap=SOFTCAP, mask=None,
               sinks=None, alibi_slopes=None, keep_first=0, layout=LAYOUT, return_lse=False, num_threads=None,
               **unknown):
        """Attention of q [B, Hq, Sq, D] (or BSHD) over the cache; out in q's framework and dtype.
        Options as qkv.attention (bottom-right aligned; sinks and alibi_slopes get no gradient
        here); TypeError / ValueError as qkv.attention."""
        if positional or unknown:
            _options.misuse(KVCache.attend, positional, unknown)
        fw = _ops._framework("q", q)
        _ops._check_float("q", q, fw)
        opts = _options.options(_options.values(scale, causal, ALIGN, window, softcap, layout,
                                                num_threads=num_threads, keep_first=keep_first))
        _ops._check_rank4("q", q, "[B,S,H,D]" if opts.bshd else "[B,H,S,D]")
        B, Sq, Hq = (q.shape[0], q.shape[1], q.shape[2]) if opts.bshd else (q.shape[0], q.shape[2], q.shape[1])
        Dv = self._c.head_dim_v
        out = _ops._empty(fw, q, (B, Sq, Hq, Dv) if opts.bshd else (B, Hq, Sq, Dv))
        lse = _ops._empty(fw, q, (B, Hq, Sq), _ops._lse_dtype(fw, q)) if return_lse else None
        self._c._attend(q, out, lse, _ops.arrays(fw, mask, None, sinks, alibi_slopes), opts)
        return (out, lse) if return_lse else out

    def clear(self):
        self._c.clear()

    def truncate(self, length):
        self._c.truncate(int(length))


class MultiHeadAttention:
    """Multi-head attention (Vaswani et al. 2017, sec. 3.2.2) with GQA, optional RoPE, learned
    attention sinks and ALiBi.

    y = (attention(x W_Q^T + b_Q, x W_K^T + b_K, x W_V^T + b_V) W_O^T + b_O), float32,
    x [B, S, d_model] (batch first). Weights use PyTorch's layout; load_state_dict() takes a
    torch.nn.MultiheadAttention state_dict (in_proj_weight, in_proj_bias, out_proj.weight,
    out_proj.bias) or separate q/k/v/o projections (docs/layers.md lists the accepted names).

    Args: d_model, num_heads; num_kv_heads (0 = num_heads), head_dim (0 = d_model/num_heads),
      head_dim_v (0 = head_dim), bias (qkv and output biases), rope (None, "interleaved" or
      "half"), rope_theta, rotary_dim (0 = head_dim); sinks: a learned attention-sink logit per
      head (gpt-oss; the weight `sinks` [num_heads], zero until loaded); alibi: ALiBi biases with
      BLOOM's slopes (qkv.alibi_slopes(num_heads)), aligned as the call's causal diagonal.
    Raises ValueError for inconsistent sizes, and on load for missing or mis-shaped weights.
    """

    def __init__(self, d_model, num_heads, *, num_kv_heads=0, head_dim=0, head_dim_v=0, bias=True, rope=None,
                 rope_theta=10000.0, rotary_dim=0, sinks=False, alibi=False):
        sinks, alibi = _options._flag("sinks", sinks), _options._flag("alibi", alibi)
        self._m = _qkv._MultiHeadAttention(d_model, num_heads, num_kv_heads, head_dim, head_dim_v, bias, bias, rope,
                                           rope_theta, rotary_dim, sinks, alibi)

    @classmethod
    def from_torch(cls, module):
        """A layer with the weights of a torch.nn.MultiheadAttention (batch_first or not).

        Raises NotImplementedError for a module built with add_bias_kv=True or add_zero_attn=True
        (an extra key/value row that this layer does not append), ValueError as load_state_dict.
        """
        if getattr(module, "bias_k", None) is not None:
            raise NotImplementedError("module: add_bias_kv=True (bias_k, bias_v) is not implemented by "
                                      "qkv.MultiHeadAttention")
        if getattr(module, "add_zero_attn", False):
            raise NotImplementedError("module: add_zero_attn=True is not implemented by qkv.MultiHeadAttention")
        layer = cls(module.embed_dim, module.num_heads, bias=module.in_proj_bias is not None)
        layer.load_state_dict(module.state_dict())
        return layer

    @property
    def config(self):
        return self._m.config()

    def load_state_dict(self, state_dict, prefix=""):
        """Copies the weights (any float dtype, converted to float32) from named arrays/tensors.

        Raises NotImplementedError for bias_k / bias_v (nn.MultiheadAttention's add_bias_kv),
        ValueError for missing or mis-shaped weights.
        """
        for name in ("bias_k", "bias_v"):
            if state_dict.get(prefix + name) is not None:
                raise NotImplementedError(f"{prefix + name}: nn.MultiheadAttention's add_bias_kv is not implemented "
                                          "by qkv.MultiHeadAttention")
        arrays = {name: _as_f32_numpy(name, x) for name, x in state_dict.items() if x is not None}
        self._m.load_weights(arrays, prefix)

    def weights(self):
        """The weights as float32 NumPy arrays: w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o, sinks (None if absent)."""
        return self._m.weights()

    @_options.keyword_only
    def __call__(self, x, x_kv=None, *positional, cache=None, causal=False, window=WINDOW, keep_first=0, scale=None,
                 softcap=SOFTCAP, mask=None, num_threads=None, **unknown):
        """y [B, S, d_model] for x [B, S, d_model] (float32, NumPy or PyTorch).

        x_kv [B, Sk, d_model]: cross-attention keys/values. cache (a KVCache of this layer's
        B, Hkv, D): x are the newest tokens, appended to the cache before attending (decoding).
        mask: qkv's polarity (bool True = attend, or additive), broadcastable to [B,Hq,Sq,Sk].
        Options as qkv.attention; TypeError / ValueError as qkv.attention.
        """
        if positional or unknown:
            _options.misuse(MultiHeadAttention.__call__, positional, unknown)
        fw = _ops._framework("x", x)
        if x.ndim != 3:
            raise ValueError(f"x: expected rank 3 [B,S,d_model], got rank {x.ndim} {list(x.shape)}")
        y = _ops._empty(fw, x, tuple(x.shape))
        opts = _options.options(_options.values(scale, causal, window=window, softcap=softcap,
                                                num_threads=num_threads, keep_first=keep_first))
        if cache is not None:
            if mask is not None or x_kv is not None:
                raise ValueError("cache: a cached call takes neither mask nor x_kv")
            self._m._forward_cached(x, cache._c, y, _options.NO_ARRAYS, opts)
        else:
            self._m._forward(x, x_kv, y, _ops.arrays(fw, mask, None), opts)
        return y
