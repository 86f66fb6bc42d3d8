"""qkv.attention and qkv.attention_backward on NumPy arrays and PyTorch CPU tensors.

Arrays reach the C++ library without a copy (NumPy arrays through DLPack or the buffer protocol,
PyTorch tensors through their data_ptr(), shape and stride(), or through DLPack): any strides are
accepted provided the last dimension is contiguous; anything else is refused with the C++
message, never copied behind the caller's back. Outputs are allocated here, in the framework and
dtype of q, and the C++ call runs with the GIL released.
"""
import math
import numbers
import operator
import sys

import numpy as np

from . import _qkv

_NUMPY_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16))
_KERNELS = ("auto", "reference", "flash", "decode")


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
                       "Tensor": torch.Tensor, "contiguous_format": torch.contiguous_format})
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
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout: expected 'bhsd' or 'bshd', got {layout!r}")
    return layout == "bshd"


def _window(window, name="window"):
    """(left, right) as ints; ValueError naming the argument for anything but a pair of integers
    (1.7 is refused, not truncated; NumPy and PyTorch integers are integers)."""
    try:
        left, right = window
        if isinstance(left, bool) or isinstance(right, bool):
            raise TypeError
        return operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a pair of integers (left, right), got {window!r}") from None


def _real(name, x):
    """A float option (scale, softcap) as a Python float: a real number, or a 0-d NumPy array or
    PyTorch tensor of a real dtype; TypeError naming it otherwise (a string is not taken)."""
    if type(x) in (float, int):
        return float(x)
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return float(x)
    if getattr(x, "ndim", None) == 0 and not isinstance(x, (str, bytes)):
        dt = str(getattr(x, "dtype", ""))
        if any(t in dt for t in ("float", "int")) and "bool" not in dt:
            return float(x)
    raise TypeError(f"{name}: expected a real number, got {type(x).__name__} {x!r}")


def _scalars(scale, softcap, causal):
    """(scale, softcap, causal) checked by type: scale None or a real, softcap a real, causal a bool."""
    return None if scale is None else _real("scale", scale), _real("softcap", softcap), _flag("causal", causal)


def _flag(name, x):
    """A bool option (causal): a bool (NumPy's too) or the integers 0 and 1; TypeError naming it
    otherwise (a string such as "no" would otherwise read as True)."""
    if isinstance(x, (bool, np.bool_)) or (type(x) is int and x in (0, 1)):
        return bool(x)
    raise TypeError(f"{name}: expected a bool, got {type(x).__name__} {x!r}")


def _dims(q, k, v, bshd):
    """(B, Hq, Sq, Sk, Dv) read from the arrays in their layout."""
    qs = q.shape  # read once: a torch.Size is built on each access
    if bshd:
        return qs[0], qs[2], qs[1], k.shape[1], v.shape[3]
    return qs[0], qs[1], qs[2], k.shape[2], v.shape[3]


def _detach(x):
    return x.detach() if x.requires_grad else x


def _forward(q, k, v, fw, bshd, scale, causal, align, wl, wr, softcap, mask, kv_lens, kernel, threads,
             want_lse, want_probs):
    """Runs the C++ forward on checked inputs; returns (out, lse or None, probs or None)."""
    B, Hq, Sq, Sk, Dv = _dims(q, k, v, bshd)
    out = None
    if fw == "torch" and Dv == q.shape[3]:
        fns = _TORCH or _torch_objs()
        if type(q) is fns["Tensor"]:
            # q's shape and dtype (a plain tensor on the CPU): the cheapest allocation of the output
            try:
                out = fns["empty_like"](q, memory_format=fns["contiguous_format"])
            except RuntimeError:  # a layout without strides: refused by the C++ call, with its name
                pass
    if out is None:
        out = _empty(fw, q, (B, Sq, Hq, Dv) if bshd else (B, Hq, Sq, Dv))
    lse = _empty(fw, q, (B, Hq, Sq), _lse_dtype(fw, q)) if want_lse else None
    probs = _empty(fw, q, (B, Hq, Sq, Sk), _lse_dtype(fw, q)) if want_probs else None
    _qkv._attention(q, k, v, out, lse, probs, bshd, scale, softcap, causal, align, wl, wr, mask, kv_lens,
                    kernel, threads)
    return out, lse, probs


def attention(q, k, v, *, scale=None, causal=False, align="bottom-right", window=(-1, -1), softcap=0.0,
              mask=None, kv_lens=None, layout="bhsd", return_lse=False, return_probs=False, kernel="auto",
              num_threads=None):
    """Scaled dot-product attention, O = softmax(mask(softcap(scale * Q K^T))) V, per head.

    Source: Vaswani et al. 2017, "Attention Is All You Need", sec. 3.2.1; the tiled kernel is
    FlashAttention-2's (Dao 2023, Alg. 1). Semantics of every option: docs/semantics.md.

    Args (arrays: numpy.ndarray or torch.Tensor on the CPU, all of one framework):
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
      layout: "bhsd" or "bshd" (of q, k, v and out).
      return_lse: also return softmax_lse [B, Hq, Sq] (natural log; float32, float64 for float64 q).
      return_probs: also return the attention weights [B, Hq, Sq, Sk] (float32/float64).
      kernel: "auto", "reference" (the float64 specification), "flash" or "decode".
      num_threads: threads inside the call (default: OpenMP's). Results never depend on it.

    Returns:
      out [B, Hq, Sq, Dv] (or [B, Sq, Hq, Dv]) in q's framework and dtype; with return_lse and/or
      return_probs a tuple (out, softmax_lse, probs) holding those asked for. PyTorch tensors that
      require grad (or a call inside torch.compile) go through the custom operator qkv::attention,
      which is differentiable.

    Raises:
      TypeError: an argument that is not a NumPy array or PyTorch tensor, arrays of different
        frameworks or dtypes, an unsupported dtype; scale or softcap not a real number, causal
        not a bool.
      ValueError: with the C++ message (argument, expected, actual): a tensor not on the CPU, a
        rank other than 4, a non-contiguous last dimension, mismatched shapes, a bad mask or
        kv_lens shape, a window that is not a pair of integers, a bad option value.
      NotImplementedError: a mask that requires grad, with grad enabled (qkv computes no mask
        gradient).
    """
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
    bshd = False if layout == "bhsd" else _layout(layout)
    wl, wr = (-1, -1) if type(window) is tuple and window == (-1, -1) else _window(window)
    if scale is not None and type(scale) is not float:
        scale = _real("scale", scale)
    if type(softcap) is not float:
        softcap = _real("softcap", softcap)
    if type(causal) is not bool:
        causal = _flag("causal", causal)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        for name, x in (("q", q), ("k", k), ("v", v)):
            _check_rank4(name, x, "[B,S,H,D]" if bshd else "[B,H,S,D]")
    if mask is not None:
        mask = _aux("mask", mask, fw, refuse_grad=True)
    if kv_lens is not None:
        kv_lens = _aux("kv_lens", kv_lens, fw)
    threads = 0 if num_threads is None else int(num_threads)
    if kernel != "auto" and kernel not in _KERNELS:
        raise ValueError(f"kernel: expected one of {', '.join(_KERNELS)}, got {kernel!r}")
    if fw == "torch":
        torch = _torch()
        if ((q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()) or \
                torch.compiler.is_compiling():
            if return_probs:
                raise ValueError("return_probs: the attention weights are not differentiable; "
                                 "call with return_probs=True under torch.no_grad()")
            from . import torch as qtorch
            out, lse = qtorch._attention_op(q, k, v, mask, kv_lens,
                                            float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
                                            bool(causal), _align(align), wl, wr, float(softcap), bshd, kernel,
                                            threads)
            return (out, lse) if return_lse else out
    out, lse, probs = _forward(q, k, v, fw, bshd, scale, causal, align, wl, wr, softcap, mask, kv_lens,
                               kernel, threads, return_lse, return_probs)
    if not (return_lse or return_probs):
        return out
    return (out,) + ((lse,) if return_lse else ()) + ((probs,) if return_probs else ())


def _align(align):
    if align in ("top-left", "top_left"):
        return True
    if align in ("bottom-right", "bottom_right"):
        return False
    raise ValueError(f"align: expected 'bottom-right' or 'top-left', got {align!r}")


def attention_backward(q, k, v, out, softmax_lse, grad_out, *, scale=None, causal=False, align="bottom-right",
                       window=(-1, -1), softcap=0.0, mask=None, kv_lens=None, layout="bhsd", grad_dtype=None,
                       kernel="auto", num_threads=None):
    """The gradients (dq, dk, dv) of a loss L given grad_out = dL/dout (FlashAttention-2 backward).

    Source: Dao 2023, "FlashAttention-2", Algorithm 2, with P recomputed from softmax_lse:
    dV = P^T dO; dP = dO V^T; D = rowsum(dO * O); dS = P * (dP - D) (softcap: times
    1 - tanh^2); dQ = scale dS K; dK = scale dS^T Q; GQA sums dK, dV over each group.

    Args: q, k, v and every option as attention() (the same values as the forward call);
      out: the forward's output (layout of q); softmax_lse: its [B, Hq, Sq] softmax_lse
      (float32 or float64); grad_out: dL/dout, out's shape, any float dtype of the framework;
      grad_dtype: dtype of the gradients: None (q's), or float32/float64 of q's framework.

    Returns: (dq, dk, dv) with the shapes and layout of q, k, v, in q's framework. Deterministic:
      bitwise the same for every num_threads and run.

    Raises: TypeError / ValueError as attention(), and ValueError for out, softmax_lse or
      grad_out of the wrong shape, kernel="decode", or kernel="flash" with float64 inputs.
    """
    fw = _framework("q", q)
    _check_float("q", q, fw)
    _same("k", k, fw, q)
    _same("v", v, fw, q)
    bshd = _layout(layout)
    wl, wr = _window(window)
    scale, softcap, causal = _scalars(scale, softcap, causal)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_rank4(name, x, "[B,S,H,D]" if bshd else "[B,H,S,D]")
    for name, x in (("out", out), ("softmax_lse", softmax_lse), ("grad_out", grad_out)):
        if _framework(name, x) != fw:
            raise TypeError(f"{name}: expected a {'numpy.ndarray' if fw == 'numpy' else 'torch.Tensor'} like q")
    mask = _aux("mask", mask, fw)
    kv_lens = _aux("kv_lens", kv_lens, fw)
    if kernel not in _KERNELS:
        raise ValueError(f"kernel: expected one of {', '.join(_KERNELS)}, got {kernel!r}")
    gd = grad_dtype if grad_dtype is not None else q.dtype
    dq, dk, dv = _empty(fw, q, q.shape, gd), _empty(fw, q, k.shape, gd), _empty(fw, q, v.shape, gd)
    _qkv._attention_backward(q, k, v, out, softmax_lse, grad_out, dq, dk, dv, bshd, scale, softcap, causal,
                             align, wl, wr, mask, kv_lens, kernel, 0 if num_threads is None else int(num_threads))
    return dq, dk, dv


def explain_dispatch(q, k, v, *, scale=None, causal=False, align="bottom-right", window=(-1, -1), softcap=0.0,
                     mask=None, kv_lens=None, layout="bhsd", kernel="auto", num_threads=None):
    """Which kernel attention() runs for these arguments and why the others refuse (one line each)."""
    fw = _framework("q", q)
    _same("k", k, fw, q)
    _same("v", v, fw, q)
    bshd = _layout(layout)
    wl, wr = _window(window)
    scale, softcap, causal = _scalars(scale, softcap, causal)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_rank4(name, x, "[B,S,H,D]" if bshd else "[B,H,S,D]")
    B, Hq, Sq, Sk, Dv = _dims(q, k, v, bshd)
    out = _empty(fw, q, (B, Sq, Hq, Dv) if bshd else (B, Hq, Sq, Dv))
    if fw == "torch":
        q, k, v = _detach(q), _detach(k), _detach(v)
    return _qkv._explain_dispatch(q, k, v, out, bshd, scale, softcap, causal, align, wl, wr,
                                  _aux("mask", mask, fw), _aux("kv_lens", kv_lens, fw), kernel,
                                  0 if num_threads is None else int(num_threads))
