"""qkv.attention and qkv.attention_backward on NumPy arrays and PyTorch CPU tensors.

Arrays reach the C++ library without a copy (NumPy arrays through DLPack or the buffer protocol,
PyTorch tensors through their data_ptr(), shape and stride(), or through DLPack): any strides are
accepted provided the last dimension is contiguous; anything else is refused with the C++
message, never copied behind the caller's back. Outputs are allocated here, in the framework and
dtype of q, and the C++ call runs with the GIL released. The options are checked and handed over
as one object (qkv/_options.py).
"""
import math
import sys

import numpy as np

from . import _options, _qkv
from ._options import ALIGN, KEPT, KERNEL, LAYOUT, NO_ARRAYS, SOFTCAP, WINDOW, keyword_only, misuse, values

_NUMPY_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16))


def _torch():
    return sys.modules.get("torch")


def _framework(name, x):
    """'numpy' or 'torch'; TypeError for anything else, ValueError for a tensor not on the CPU."""
    if isinstance(x, np.ndarray):
        return "numpy"
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_cpu:
            raise ValueError(f"{name}: expected a tensor in CPU memory, got one on device '{x.device}' "
                             "(qkv computes on the CPU; move it with .cpu() explicitly)")
        return "torch"
    raise TypeError(f"{name}: expected a numpy.ndarray or a torch.Tensor, got {type(x).__module__}."
                    f"{type(x).__name__}")


def _check_float(name, x, fw):
    if fw == "numpy":
        if x.dtype not in _NUMPY_DTYPES:
            raise TypeError(f"{name}: expected dtype float32, float64 or float16, got {x.dtype}")
    else:
        if x.dtype not in _torch_objs()["floats"]:
            raise TypeError(f"{name}: expected dtype float32, float64, float16 or bfloat16, got {x.dtype}")


def _check_rank4(name, x, letters):
    if x.ndim != 4:
        raise ValueError(f"{name}: expected rank 4 {letters}, got rank {x.ndim} {list(x.shape)}")


def _same(name, x, fw, q):
    """x must be of q's framework and dtype (no silent conversion)."""
    xfw = _framework(name, x)
    if xfw != fw:
        raise TypeError(f"{name}: expected a {'numpy.ndarray' if fw == 'numpy' else 'torch.Tensor'} like q, "
                        f"got a {'numpy.ndarray' if xfw == 'numpy' else 'torch.Tensor'}")
    if x.dtype != q.dtype:
        raise TypeError(f"{name}: expected dtype {q.dtype} (q's dtype), got {x.dtype}")


def _aux(name, x, fw, refuse_grad=False):
    """A mask or key-length array: same framework as q, any dtype the C++ API accepts. Where the
    call is differentiable (refuse_grad), one that requires grad is refused: it would get none."""
    if x is None:
        return None
    xfw = _framework(name, x)
    if xfw != fw:
        raise TypeError(f"{name}: expected a {'numpy.ndarray' if fw == 'numpy' else 'torch.Tensor'} like q")
    if fw == "torch" and x.requires_grad:
        if refuse_grad and _torch().is_grad_enabled():
            # a mask that requires grad would silently get none: say so instead
            raise NotImplementedError(f"{name}: qkv computes no gradient for the {name}, and this one requires "
                                      f"grad; pass {name}.detach() (or call under torch.no_grad())")
        x = x.detach()
    return x


# torch's objects that the calls compare against or call, looked up once (after the caller has
# imported torch; qkv never imports it), so that attention() recognises a CPU float tensor and
# allocates its output with a few comparisons.
_TORCH = {}


def _torch_objs():
    if not _TORCH:
        torch = _torch()
        _TORCH.update({torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                       "floats": (torch.float32, torch.float64, torch.float16, torch.bfloat16),
                       "from_numpy": torch.from_numpy, "empty": torch.empty, "empty_like": torch.empty_like,
                       "Tensor": torch.Tensor, "contiguous_format": torch.contiguous_format,
                       "is_grad_enabled": torch.is_grad_enabled, "is_compiling": torch.compiler.is_compiling})
    return _TORCH


def _empty(fw, like, shape, dtype=None):
    """A new output in the framework of `like`, of `like`'s dtype or `dtype`."""
    if fw == "numpy":
        return np.empty(shape, dtype=like.dtype if dtype is None else dtype)
    dt = like.dtype if dtype is None else dtype
    fns = _TORCH or _torch_objs()
    npdt = fns.get(dt)
    if npdt is not None and math.prod(shape) <= 4096:
        # A small output through NumPy: cheaper than torch.empty(...) at the size of a decode step,
        # where the allocation is much of a call. Large outputs (and everything that autograd
        # keeps) are PyTorch's own.
        return fns["from_numpy"](np.empty(shape, dtype=npdt))
    return fns["empty"](shape, dtype=dt, device="cpu")  # not the default device a caller may have set


def _lse_dtype(fw, q):
    if fw == "numpy":
        return np.float64 if q.dtype == np.float64 else np.float32
    torch = _torch()
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _layout(layout):
    """The `bshd` flag of a layout outside the attention options (KVCache.append)."""
    return _options._choice(None, "layout", layout) == "bshd"


def _detach(x):
    return x.detach() if x.requires_grad else x


def _tensors(q, k, v):
    """The framework of q, k, v ('numpy' or 'torch'): arrays of one framework and one float dtype,
    tensors on the CPU; TypeError / ValueError naming the one that is not."""
    # The common case is checked with a few comparisons (a call costs microseconds); the helpers
    # run, and raise with the full message, only when something differs.
    if type(q) is np.ndarray:
        fw = "numpy"
        if q.dtype not in _NUMPY_DTYPES:
            _check_float("q", q, fw)
    elif _TORCH and type(q) is _TORCH["Tensor"] and q.dtype in _TORCH["floats"] and q.is_cpu:
        fw = "torch"
    else:
        fw = _framework("q", q)
        _check_float("q", q, fw)
    if type(k) is not type(q) or k.dtype != q.dtype:
        _same("k", k, fw, q)
    if type(v) is not type(q) or v.dtype != q.dtype:
        _same("v", v, fw, q)
    if fw == "torch" and not (k.is_cpu and v.is_cpu):
        _same("k", k, fw, q)  # raises ValueError naming the one not on the CPU
        _same("v", v, fw, q)
    return fw


def _ranks(q, k, v, layout):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        for name, x in (("q", q), ("k", k), ("v", v)):
            _check_rank4(name, x, "[B,S,H,D]" if layout == "bshd" else "[B,H,S,D]")


# The position of the attention sinks in the arrays tuple: the one array option with a gradient.
SINKS = [name for name, _ in _options.ARRAY_OPTIONS].index("sinks")


def _sinks(x, fw, differentiable):
    """The attention sinks [Hq]: q's framework, float32 (the library's dtype for them, whatever q's);
    float16 / bfloat16 (a model's dtype) are widened to float32 exactly (a copy of Hq numbers),
    float64 is refused rather than rounded. Where the call is differentiable a tensor that requires
    grad is kept (autograd gives it its gradient, through the widening too), else detached."""
    if x is None:
        return None
    xfw = _framework("sinks", x)
    if xfw != fw:
        raise TypeError(f"sinks: expected a {'numpy.ndarray' if fw == 'numpy' else 'torch.Tensor'} like q")
    expected = "sinks: expected dtype float32 (float16 and bfloat16 are widened exactly; float64 is not rounded " \
               "behind your back: pass float32 sinks)"
    if fw == "numpy":
        if x.dtype == np.float16:
            return x.astype(np.float32)
        if x.dtype != np.float32:
            raise TypeError(f"{expected}, got {x.dtype}")
        return x
    torch = _torch()
    if not (differentiable and x.requires_grad and torch.is_grad_enabled()):
        x = _detach(x)
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    if x.dtype != torch.float32:
        raise TypeError(f"{expected}, got {x.dtype}")
    return x


def arrays(fw, mask=None, kv_lens=None, sinks=None, alibi_slopes=None, names=None, differentiable=False):
    """The array options as the tuple the C++ entry points take (_options.ARRAY_OPTIONS' order), each
    checked by _aux (the sinks by _sinks); differentiable: the call computes gradients, so a mask
    or ALiBi slopes that require grad are refused rather than silently given none, and sinks that
    require grad are kept for their gradient."""
    if mask is None and kv_lens is None and sinks is None and alibi_slopes is None:
        return NO_ARRAYS
    return (_aux(_options._named(names, "mask"), mask, fw, refuse_grad=differentiable), _aux("kv_lens", kv_lens, fw),
            _sinks(sinks, fw, differentiable), _aux("alibi_slopes", alibi_slopes, fw, refuse_grad=differentiable))


def _forward(q, k, v, fw, arrays, opts, want_lse, want_probs):
    """Runs the C++ forward on checked inputs; returns (out, lse or None, probs or None)."""
    qs = q.shape  # read once: a torch.Size is built on each access
    Dv = v.shape[3]
    out = None
    if fw == "torch" and Dv == qs[3]:
        fns = _TORCH or _torch_objs()
        if type(q) is fns["Tensor"]:
            # q's shape and dtype (a plain tensor on the CPU): the cheapest allocation of the output
            try:
                out = fns["empty_like"](q, memory_format=fns["contiguous_format"])
            except RuntimeError:  # a layout without strides: refused by the C++ call, with its name
                pass
    elif fw == "numpy":
        out = np.empty((qs[0], qs[1], qs[2], Dv), q.dtype)  # [B, Hq, Sq, Dv] or [B, Sq, Hq, Dv]: q's layout
    if out is None:
        out = _empty(fw, q, (qs[0], qs[1], qs[2], Dv))
    lse = probs = None
    if want_lse or want_probs:
        bshd = opts.bshd
        B, Hq, Sq, Sk = (qs[0], qs[2], qs[1], k.shape[1]) if bshd else (qs[0], qs[1], qs[2], k.shape[2])
        lse = _empty(fw, q, (B, Hq, Sq), _lse_dtype(fw, q)) if want_lse else None
        probs = _empty(fw, q, (B, Hq, Sq, Sk), _lse_dtype(fw, q)) if want_probs else None
    _qkv._attention(q, k, v, out, lse, probs, arrays, opts)
    return out, lse, probs


def _run(q, k, v, fw, arrays, key, want_lse, want_probs):
    """(out, lse or None, probs or None) of checked inputs and a values() key: tensors that require
    grad (with grad enabled) and calls inside torch.compile take qkv.torch's differentiable paths,
    everything else the C++ forward directly."""
    if fw == "torch":
        fns = _TORCH or _torch_objs()
        sinks = arrays[SINKS]
        if (fns["is_grad_enabled"]() and (q.requires_grad or k.requires_grad or v.requires_grad or
                                          (sinks is not None and sinks.requires_grad))) or fns["is_compiling"]():
            if want_probs:
                raise ValueError("return_probs: the attention weights are not differentiable; "
                                 "call with return_probs=True under torch.no_grad()")
            out, lse = _differentiable(q, k, v, arrays, key)
            return out, lse, None
    return _forward(q, k, v, fw, arrays, KEPT.get(key) or _options.options(key), want_lse, want_probs)


def _differentiable(q, k, v, arrays, key):
    """qkv.torch._differentiable, which replaces this function when qkv.torch is imported (here on
    the first differentiable call: PyTorch is never imported by qkv itself)."""
    from . import torch as qtorch
    return qtorch._differentiable(q, k, v, arrays, key)


def _grad_dtype(fw, q, dt):
    """attention_backward's grad_dtype as a dtype of q's framework: None (q's), float32, float64 or
    q's dtype, given as the framework's dtype or by name; TypeError / ValueError naming it."""
    if dt is None:
        return None
    torch = _torch() if fw == "torch" else None
    qname = q.dtype.name if fw == "numpy" else str(q.dtype).removeprefix("torch.")
    name = None
    if isinstance(dt, str):
        name = dt
    elif torch is not None:
        if isinstance(dt, torch.dtype):
            name = str(dt).removeprefix("torch.")
    else:
        try:
            name = np.dtype(dt).name  # a NumPy type or dtype
        except TypeError:
            pass
    expected = f"None, float32, float64 or q's dtype ({qname}), as a dtype of q's framework or its name"
    if name is None:
        raise TypeError(f"grad_dtype: expected {expected}, got {type(dt).__name__} {dt!r}")
    if name not in ("float32", "float64", qname):
        raise ValueError(f"grad_dtype: expected {expected}, got {dt!r}")
    return np.dtype(name) if torch is None else getattr(torch, name)


def _backward(q, k, v, out, softmax_lse, grad_out, fw, arrays, opts, grad_dtype=None):
    """Runs the C++ backward on checked inputs; returns (dq, dk, dv) in grad_dtype (None: q's), and
    with sinks among the arrays (dq, dk, dv, dsinks), dsinks float32 [Hq]."""
    dq, dk, dv = (_empty(fw, q, x.shape, grad_dtype) for x in (q, k, v))
    if arrays[SINKS] is None:
        _qkv._attention_backward(q, k, v, out, softmax_lse, grad_out, dq, dk, dv, arrays, opts)
        return dq, dk, dv
    Hq = q.shape[2] if opts.bshd and q.ndim == 4 else q.shape[1]
    dsinks = _empty(fw, q, (Hq,), np.float32 if fw == "numpy" else _torch().float32)
    _qkv._attention_backward(q, k, v, out, softmax_lse, grad_out, dq, dk, dv, arrays, opts, dsinks)
    return dq, dk, dv, dsinks


@keyword_only
def attention(q, k, v, *positional, scale=None, causal=False, align=ALIGN, window=WINDOW, softcap=SOFTCAP,
              mask=None, kv_lens=None, sinks=None, alibi_slopes=None, keep_first=0, layout=LAYOUT, return_lse=False,
              return_probs=False, kernel=KERNEL, num_threads=None, **unknown):
    """Scaled dot-product attention, O = softmax(mask(softcap(scale * Q K^T))) V, per head.

    Source: Vaswani et al. 2017, "Attention Is All You Need", sec. 3.2.1; the tiled kernel is
    FlashAttention-2's (Dao 2023, Alg. 1). Semantics of every option: docs/semantics.md.

    Args (arrays: numpy.ndarray or torch.Tensor on the CPU, all of one framework; every option is
      keyword-only):
      q: [B, Hq, Sq, D] (layout "bhsd") or [B, Sq, Hq, D] ("bshd"); float32, float64, float16,
        or bfloat16 (PyTorch). Any strides with a contiguous last dimension: never copied.
      k: [B, Hkv, Sk, D] / [B, Sk, Hkv, D], Hq % Hkv == 0 (GQA/MQA); q's dtype.
      v: [B, Hkv, Sk, Dv] / [B, Sk, Hkv, Dv]; q's dtype.
      scale: multiplies q.k; default 1/sqrt(D).
      causal: mask keys after the diagonal (shorthand for window (-1, 0)).
      align: "bottom-right" (default; FlashAttention >= 2.1, KV-cache decoding: the last query
        sees the last key) or "top-left" (PyTorch is_causal) when Sq != Sk.
      window: (left, right) sliding window around the diagonal; -1 = unbounded.
      softcap: if > 0, score = softcap * tanh(score / softcap) (Gemma 2).
      mask: broadcastable to [B, Hq, Sq, Sk]: bool (True = attend) or float32/float64 (added).
      kv_lens: int32/int64 [B]: keys j >= kv_lens[b] are excluded.
      sinks: float32 [Hq] attention-sink logits z_h (gpt-oss; float16/bfloat16 widened exactly),
        whatever q's dtype: each row's softmax gets one more term exp(z_h) that carries no value,
        p_ij = exp(s_ij) / (exp(z_h) + sum_j exp(s_ij)); softmax_lse includes it; a row with no
        admissible key gives out = 0 and softmax_lse = z_h. Differentiable (PyTorch).
      alibi_slopes: float32 [Hq] or [B, Hq] (Press et al. 2022, ALiBi; qkv.alibi_slopes gives
        BLOOM's): adds -slope * |i + offset - j| to the score after scale and softcap, before the
        masks; offset is the diagonal's (align). No gradient.
      keep_first: an integer >= 0: keys 0 .. keep_first-1 are admissible to every query besides its
        window (StreamingLLM's attention sinks, Xiao et al. 2023): it extends the window's left
        side only; causal, window's right side, kv_lens and mask still exclude.
      layout: "bhsd" or "bshd" (of q, k, v and out).
      return_lse: also return softmax_lse [B, Hq, Sq] (natural log; float32, float64 for float64 q).
      return_probs: also return the attention weights [B, Hq, Sq, Sk] (float32/float64).
      kernel: "auto", "reference" (the float64 specification), "flash" or "decode".
      num_threads: threads inside the call (default: OpenMP's). Results never depend on it.

    Returns:
      out [B, Hq, Sq, Dv] (or [B, Sq, Hq, Dv]) in q's framework and dtype; with return_lse and/or
      return_probs a tuple (out, softmax_lse, probs) holding those asked for. PyTorch tensors that
      require grad (with grad enabled) are differentiable (FlashAttention-2's backward); inside
      torch.compile the call is the custom operator torch.ops.qkv.attention.

    Raises:
      TypeError: an argument that is not a NumPy array or PyTorch tensor, arrays of different
        frameworks or dtypes, an unsupported dtype; an option passed by position or a keyword
        attention() does not take (naming it, and the option meant for a misspelling); scale or
        softcap not a real number, causal not a bool, num_threads not an integer.
      ValueError: with the C++ message (argument, expected, actual): a tensor not on the CPU, a
        rank other than 4, a non-contiguous last dimension, mismatched shapes, a bad mask or
        kv_lens shape, sinks or alibi_slopes of the wrong shape or dtype, a window that is not a
        pair of integers, keep_first < 0, a bad option value; a kernel forced onto an option it
        does not implement.
      NotImplementedError: a mask or alibi_slopes that requires grad, with grad enabled (qkv
        computes no gradient for them).
    """
    if positional or unknown:
        misuse(attention, positional, unknown)
    fw = _tensors(q, k, v)
    key = values(scale, causal, align, window, softcap, layout, kernel, num_threads, keep_first)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        _ranks(q, k, v, layout)
    arr = NO_ARRAYS if mask is None and kv_lens is None and sinks is None and alibi_slopes is None else \
        arrays(fw, mask, kv_lens, sinks, alibi_slopes, differentiable=True)
    if fw == "numpy":  # never differentiable: straight to the C++ call
        out, lse, probs = _forward(q, k, v, fw, arr, KEPT.get(key) or _options.options(key), return_lse, return_probs)
    else:
        out, lse, probs = _run(q, k, v, fw, arr, key, return_lse, return_probs)
    if not (return_lse or return_probs):
        return out
    return (out,) + ((lse,) if return_lse else ()) + ((probs,) if return_probs else ())


@keyword_only
def attention_backward(q, k, v, out, softmax_lse, grad_out, *positional, scale=None, causal=False,
                       align=ALIGN, window=WINDOW, softcap=SOFTCAP, mask=None, kv_lens=None, sinks=None,
                       alibi_slopes=None, keep_first=0, layout=LAYOUT, grad_dtype=None, kernel=KERNEL,
                       num_threads=None, **unknown):
    """The gradients (dq, dk, dv) of a loss L given grad_out = dL/dout (FlashAttention-2 backward),
    and with sinks also dsinks.

    Source: Dao 2023, "FlashAttention-2", Algorithm 2, with P recomputed from softmax_lse:
    dV = P^T dO; dP = dO V^T; D = rowsum(dO * O); dS = P * (dP - D) (softcap: times
    1 - tanh^2); dQ = scale dS K; dK = scale dS^T Q; GQA sums dK, dV over each group. The sink
    z_h is one more logit of each row's softmax carrying no value, so its weight p_sink = exp(z_h -
    lse) gets dz_h = -sum over the rows of head h (all batches) of p_sink * D.

    Args: q, k, v and every option as attention() (the same values as the forward call);
      out: the forward's output (layout of q); softmax_lse: its [B, Hq, Sq] softmax_lse
      (float32 or float64); grad_out: dL/dout, out's shape, any float dtype of the framework;
      grad_dtype: dtype of the gradients: None (q's), float32 or float64, as a dtype of q's
        framework or its name ("float64").

    Returns: (dq, dk, dv) with the shapes and layout of q, k, v, in q's framework; with sinks given
      the 4-tuple (dq, dk, dv, dsinks), dsinks float32 [Hq] (summed over batch and rows). The ALiBi
      slopes get no gradient. Deterministic: bitwise the same for every num_threads and run.

    Raises: TypeError / ValueError as attention(), and ValueError for out, softmax_lse or
      grad_out of the wrong shape, kernel="decode", or kernel="flash" with float64 inputs;
      TypeError for a grad_dtype that is not a dtype of q's framework or a name, ValueError for
      one other than float32, float64 or q's dtype.
    """
    if positional or unknown:
        misuse(attention_backward, positional, unknown)
    fw = _tensors(q, k, v)
    key = values(scale, causal, align, window, softcap, layout, kernel, num_threads, keep_first)
    _ranks(q, k, v, layout)
    for name, x in (("out", out), ("softmax_lse", softmax_lse), ("grad_out", grad_out)):
        if _framework(name, x) != fw:
            raise TypeError(f"{name}: expected a {'numpy.ndarray' if fw == 'numpy' else 'torch.Tensor'} like q")
    return _backward(q, k, v, out, softmax_lse, grad_out, fw, arrays(fw, mask, kv_lens, sinks, alibi_slopes),
                     KEPT.get(key) or _options.options(key), _grad_dtype(fw, q, grad_dtype))


@keyword_only
def explain_dispatch(q, k, v, *positional, scale=None, causal=False, align=ALIGN, window=WINDOW,
                     softcap=SOFTCAP, mask=None, kv_lens=None, sinks=None, alibi_slopes=None, keep_first=0,
                     layout=LAYOUT, kernel=KERNEL, num_threads=None, backward=False, **unknown):
    """Which kernel attention() runs for these arguments and why the others refuse (one line each).

    With backward=True, the same for attention_backward() of these arguments (the gradients in q's
    dtype): "flash" (FlashAttention-2 backward) or "reference" (float64). Nothing is computed.

    Args and Raises: as attention(); backward must be a bool."""
    if positional or unknown:
        misuse(explain_dispatch, positional, unknown)
    fw = _tensors(q, k, v)
    key = values(scale, causal, align, window, softcap, layout, kernel, num_threads, keep_first)
    _ranks(q, k, v, layout)
    backward = _options._flag("backward", backward)
    arr = arrays(fw, mask, kv_lens, sinks, alibi_slopes)
    qs = q.shape
    out = _empty(fw, q, (qs[0], qs[1], qs[2], v.shape[3]))
    opts = KEPT.get(key) or _options.options(key)
    if not backward:
        return _qkv._explain_dispatch(q, k, v, out, arr, opts)
    B, Hq, Sq = (qs[0], qs[2], qs[1]) if layout == "bshd" else (qs[0], qs[1], qs[2])
    lse = _empty(fw, q, (B, Hq, Sq), _lse_dtype(fw, q))
    grads = (_empty(fw, q, tuple(q.shape)), _empty(fw, q, tuple(k.shape)), _empty(fw, q, tuple(v.shape)))
    dsinks = None if sinks is None else _empty(fw, q, (Hq,), np.float32 if fw == "numpy" else _torch().float32)
    return _qkv._explain_dispatch_backward(q, k, v, out, lse, out, *grads, arr, opts, dsinks)


def alibi_slopes(num_heads):
    """BLOOM's standard ALiBi slopes of num_heads heads, a float32 NumPy array [num_heads].

    Source: Press et al. 2022, "Train Short, Test Long" (ALiBi), sec. 3: for n heads, a power of
    two, slope_h = 2^(-8 h / n), h = 1..n; otherwise the slopes of the next lower power of two,
    followed by every other slope of twice that many (BLOOM's build_alibi_tensor). The C++
    qkv::alibi_slopes computes them. Pass them (or any slopes) as alibi_slopes= (wrap in
    torch.from_numpy for PyTorch calls).

    Raises: TypeError for a num_heads that is not an integer; ValueError for num_heads < 0 (0 gives
      no slope).
    """
    n = _options._integer("num_heads", num_heads, "an integer >= 0")
    if n < 0:
        raise ValueError(f"num_heads: expected an integer >= 0, got {n}")
    return np.asarray(_qkv._alibi_slopes(n), dtype=np.float32)
