"""The Python boundary: zero-copy views, outputs in the caller's framework and dtype, the GIL
released during the kernels, and clear errors for bad input (never a crash, never a silent copy)."""
import threading
import time

import numpy as np
import pytest
import torch

import qkv
from qkv import _qkv


def test_zero_copy_numpy_and_torch_strided_views():
    buf = np.random.rand(2, 9, 3, 4, 16).astype(np.float32)  # packed [B, S, 3, H, D]
    q = buf[:, :, 0]                                        # BSHD view, strides not C-contiguous
    ptr, shape, strides, dtype = _qkv._view_info(q)
    assert ptr == q.ctypes.data and shape == [2, 9, 4, 16] and strides == [9 * 3 * 4 * 16, 3 * 4 * 16, 16, 1]
    t = torch.randn(2, 9, 3, 4, 16, dtype=torch.bfloat16)
    for view in (t[:, :, 1], t[:, :, 2].transpose(1, 2), t[:, 1:, 0]):
        ptr, shape, strides, dtype = _qkv._view_info(view)
        assert ptr == view.data_ptr() and list(view.stride()) == strides and dtype == "bfloat16"
    # tensors are read through their accessors: the same memory, shape and strides in elements
    for view in (t[:, :, 1], t.float()[:, 2:, 0].transpose(1, 2), torch.nn.Parameter(torch.randn(2, 3))):
        ptr, shape, strides, _ = _qkv._view_info(view)
        assert ptr == view.data_ptr() and strides == list(view.stride()) and shape == list(view.shape)
    # a leaf that requires grad is read in place too (same storage)
    g = torch.randn(1, 2, 3, 8, requires_grad=True)
    assert _qkv._view_info(g)[0] == g.data_ptr() and _qkv._view_info(g.detach())[0] == g.data_ptr()
    # refused with the argument's name: a dtype qkv has no code for (through DLPack), a sparse
    # layout, and a lazily negated view, whose memory holds the values before negation (DLPack
    # handed that memory over as it was, and attention computed on the unnegated values)
    with pytest.raises(TypeError, match="array: expected dtype"):
        _qkv._view_info(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="array: expected a strided"):
        _qkv._view_info(torch.randn(2, 3).to_sparse())
    x = torch._neg_view(torch.randn(1, 1, 2, 8))
    with pytest.raises(ValueError, match="k: expected a tensor without the negative bit"):
        qkv.attention(x.resolve_neg(), x, x)
    y = torch.randn(1, 1, 2, 8).to_sparse()
    with pytest.raises(TypeError, match="q: expected a strided"):
        qkv.attention(y, y, y)


def test_numpy_calls_with_torch_hidden():
    # sys.modules["torch"] = None (how tests hide a package): NumPy calls neither fail nor look
    # for torch on every array
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None\n"
            "import numpy as np, qkv\n"
            "a = np.random.rand(1, 2, 3, 8).astype(np.float32)\n"
            "o, lse = qkv.attention(a, a, a, return_lse=True)\n"
            "dq, dk, dv = qkv.attention_backward(a, a, a, o, lse, np.ones_like(o))\n"
            "assert o.shape == dq.shape == (1, 2, 3, 8)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_empty_numpy_arrays_as_empty_tensors():
    """NumPy 2 gives an array with a zero-size axis zero strides; such an array holds no element,
    so qkv takes it as PyTorch's empty tensor of the same shape (whose strides are contiguous)."""
    shapes = [((0, 4, 1, 8), (0, 2, 3, 8)), ((1, 4, 0, 8), (1, 2, 3, 8)), ((1, 4, 2, 8), (1, 2, 0, 8))]
    for qs, ks in shapes:
        q, k = np.random.rand(*qs).astype(np.float32), np.random.rand(*ks).astype(np.float32)
        out, lse = qkv.attention(q, k, k, return_lse=True)
        want, want_lse = qkv.attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(k), return_lse=True)
        assert out.shape == qs and np.array_equal(out, want.numpy()) and np.array_equal(lse, want_lse.numpy())
        grads = qkv.attention_backward(q, k, k, out, lse, np.ones_like(out))
        assert [g.shape for g in grads] == [qs, ks, ks]
        assert qkv.explain_dispatch(q, k, k).count(": chosen") == 1
    cache = qkv.KVCache(1, 2, 4, 8)
    cache.append(np.zeros((1, 2, 0, 8), np.float32), np.zeros((1, 2, 0, 8), np.float32))  # no token
    assert cache.lengths == [0]


def test_strided_views_give_the_contiguous_result():
    t = torch.randn(2, 9, 3, 4, 16)
    q, k, v = t.unbind(2)  # BSHD views into one packed buffer
    out = qkv.attention(q, k, v, layout="bshd", causal=True)
    ref = qkv.attention(*(x.contiguous() for x in (q, k, v)), layout="bshd", causal=True)
    assert torch.equal(out, ref) and out.shape == (2, 9, 4, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_outputs_in_callers_framework_and_dtype(dtype):
    q = torch.randn(1, 2, 5, 8, dtype=dtype)
    out, lse = qkv.attention(q, q, q, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == (1, 2, 5, 8)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    n = np.random.rand(1, 2, 5, 8).astype(np.float64)
    assert isinstance(qkv.attention(n, n, n), np.ndarray) and qkv.attention(n, n, n).dtype == np.float64


def _largest_gap_during_a_call(step):
    """One long single-threaded qkv call runs in a worker thread while this thread repeats
    step(); returns the largest gap between this thread's steps within the call's span, as a
    fraction of the span. A call that released the GIL leaves gaps of a scheduler slice at most;
    one holding it stops this thread for the whole call (a gap of nearly 1, whichever thread
    took the GIL first). Judged from intervals, not speed, so a busy machine cannot make it fail."""
    q = np.random.rand(1, 8, 4096, 64).astype(np.float32)
    span = []

    def worker():
        t0 = time.perf_counter()
        qkv.attention(q, q, q, num_threads=1)
        span.extend([t0, time.perf_counter()])

    t = threading.Thread(target=worker)
    stamps = []
    t.start()
    while t.is_alive():
        step()
        stamps.append(time.perf_counter())
    t.join()
    a, b = span
    points = [a] + [x for x in stamps if a < x < b] + [b]
    return max(y - x for x, y in zip(points, points[1:])) / (b - a)


def test_gil_released_two_threads_overlap():
    """Two Python threads calling qkv run at once: this one completes many small qkv calls while
    the other is inside one long call."""
    small = np.random.rand(1, 1, 16, 32).astype(np.float32)
    gap = _largest_gap_during_a_call(lambda: qkv.attention(small, small, small, num_threads=1))
    assert gap < 0.5, f"this thread stopped for {gap:.0%} of the other thread's call"


def test_gil_released_main_thread_runs_during_a_call():
    gap = _largest_gap_during_a_call(lambda: None)
    assert gap < 0.5, f"the main thread stopped for {gap:.0%} of the call"


def bad(exc, match, *args, **kw):
    with pytest.raises(exc, match=match):
        qkv.attention(*args, **kw)


def test_bad_inputs():
    q = torch.randn(1, 2, 4, 8)
    meta = torch.randn(1, 2, 4, 8, device="meta")
    bad(ValueError, "q: expected a tensor in CPU memory", meta, q, q)
    bad(ValueError, "k: expected a tensor in CPU memory", q, meta, q)
    bad(ValueError, "v: expected a tensor in CPU memory", q, q, meta)
    # on the differentiable path too (the operator would otherwise dispatch to its fake kernel)
    bad(ValueError, "k: expected a tensor in CPU memory", q.clone().requires_grad_(), meta, q)
    bad(ValueError, "v: expected a tensor in CPU memory", q.clone().requires_grad_(), q, meta)
    bad(ValueError, "window: expected a pair of integers", q, q, q, window=(1.7, 0))
    bad(TypeError, "scale: expected a real number", q, q, q, scale="x")
    bad(TypeError, "softcap: expected a real number", q, q, q, softcap=None)
    bad(TypeError, "causal: expected a bool", q, q, q, causal="no")
    # a mask that requires grad would get no gradient: refused, not silently detached
    mg = torch.randn(1, 2, 4, 4, requires_grad=True)
    bad(NotImplementedError, "mask: qkv computes no gradient", q, q, q, mask=mg)
    with torch.no_grad():
        assert qkv.attention(q, q, q, mask=mg).shape == q.shape
    bad(ValueError, "rank 4", torch.randn(2, 4, 8), q, q)
    bad(TypeError, "dtype", q, q.double(), q)
    bad(TypeError, "dtype", q.int(), q, q)
    bad(TypeError, "numpy.ndarray or a torch.Tensor", [[1.0]], q, q)
    bad(TypeError, "like q", q, q.numpy(), q)
    bad(ValueError, "contiguous last dimension", torch.randn(1, 2, 4, 16)[..., ::2], q, q)
    bad(ValueError, "mask", q, q, q, mask=torch.ones(3, 5, dtype=torch.bool))
    bad(ValueError, "kv_lens", q, q, q, kv_lens=torch.tensor([9]))
    bad(ValueError, "k", q, torch.randn(1, 2, 4, 7), q)
    bad(ValueError, "k", q, torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8))
    bad(ValueError, "align", q, q, q, align="middle")
    bad(ValueError, "window", q, q, q, window=(-3, 1))
    bad(ValueError, "softcap", q, q, q, softcap=-1.0)
    bad(ValueError, "scale", q, q, q, scale=float("nan"))
    bad(ValueError, "layout", q, q, q, layout="sbhd")
    bad(ValueError, "kernel", q, q, q, kernel="fast")
    n = np.random.rand(1, 2, 4, 8).astype(np.float32)
    bad(ValueError, "contiguous last dimension", np.asfortranarray(n), n, n)
    bad(TypeError, "dtype", n.astype(np.int32), n, n)
    with pytest.raises(ValueError, match="grad_out"):
        o, lse = qkv.attention(q, q, q, return_lse=True)
        qkv.attention_backward(q, q, q, o, lse, torch.randn(1, 2, 4, 9))


def test_call_overhead_is_small():
    """A 1-element problem costs microseconds from Python (budget generous for a shared machine)."""
    q = np.random.rand(1, 1, 1, 8).astype(np.float32)
    for _ in range(100):
        qkv.attention(q, q, q)
    best = min(_timed(lambda: qkv.attention(q, q, q), 200) for _ in range(5))
    assert best < 100e-6, best


def _timed(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n
