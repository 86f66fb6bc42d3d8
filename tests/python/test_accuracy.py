"""Forward and every gradient of qkv (through the custom operator, i.e. autograd) against
PyTorch's scaled_dot_product_attention in float64, with FlashAttention's rule: the error of qkv's
fp32 (bf16) result is at most 2x that of PyTorch's fp32 (bf16) math path, plus a floor."""
import numpy as np
import pytest
import torch

import qkv
from conftest import assert_within_rule, option_mask, reference

# (B, Hq, Hkv, Sq, Sk, D, Dv, options); no query row is left without a key (PyTorch gives NaN there).
CASES = [
    (2, 2, 2, 17, 17, 16, 16, {}),
    (1, 4, 4, 1, 37, 64, 64, {}),
    (2, 4, 1, 33, 33, 8, 8, {"causal": True}),
    (1, 2, 2, 7, 29, 17, 17, {"causal": True}),                       # bottom-right, Sq < Sk
    (1, 2, 2, 29, 7, 17, 17, {"causal": True, "top_left": True}),     # top-left, Sq > Sk
    (2, 4, 2, 31, 31, 32, 16, {"window": (5, 3)}),
    (1, 2, 2, 19, 40, 24, 24, {"window": (4, 0), "causal": True}),
    (2, 2, 2, 23, 23, 16, 16, {"softcap": 5.0}),
    (2, 4, 2, 20, 20, 16, 16, {"softcap": 2.0, "causal": True}),
    (2, 2, 2, 13, 21, 16, 16, {"mask": "bool"}),
    (2, 2, 2, 13, 21, 16, 16, {"mask": "float"}),
    (3, 2, 1, 9, 26, 16, 16, {"kv_lens": [26, 12, 9]}),
    (3, 2, 2, 9, 26, 16, 16, {"kv_lens": [26, 12, 9], "causal": True}),
    (1, 8, 2, 41, 41, 64, 64, {"scale": 0.3, "causal": True}),
    (2, 2, 2, 15, 15, 33, 33, {"layout": "bshd", "causal": True}),
]


def make(B, Hq, Hkv, Sq, Sk, D, Dv, opts):
    q = torch.randn(B, Hq, Sq, D, dtype=torch.float64)
    k = torch.randn(B, Hkv, Sk, D, dtype=torch.float64)
    v = torch.randn(B, Hkv, Sk, Dv, dtype=torch.float64)
    mask = None
    if opts.get("mask") == "bool":
        mask = torch.rand(B, 1, Sq, Sk) < 0.7
        mask[..., 0] = True
    elif opts.get("mask") == "float":
        mask = torch.randn(B, Hq, Sq, Sk, dtype=torch.float64)
    kv_lens = torch.tensor(opts["kv_lens"], dtype=torch.int32) if "kv_lens" in opts else None
    return q, k, v, mask, kv_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[:7]}{sorted(c[7])}" for c in CASES])
def test_forward_and_gradients(case, dtype):
    B, Hq, Hkv, Sq, Sk, D, Dv, opts = case
    q64, k64, v64, mask, kv_lens = make(*case)
    add = option_mask(B, Hq, Sq, Sk, causal=opts.get("causal", False), top_left=opts.get("top_left", False),
                      window=opts.get("window", (-1, -1)), kv_lens=kv_lens, mask=mask)
    scale, softcap = opts.get("scale"), opts.get("softcap", 0.0)
    do64 = torch.randn(B, Hq, Sq, Dv, dtype=torch.float64)

    def run_ref(dt):
        q, k, v = (x.to(dt).clone().requires_grad_() for x in (q64, k64, v64))
        o = reference(q, k, v, scale=scale, softcap=softcap, add=add)
        o.backward(do64.to(dt))
        return o, q.grad, k.grad, v.grad

    ref = run_ref(torch.float64)
    low = run_ref(dtype)

    bshd = opts.get("layout") == "bshd"
    q, k, v = (x.to(dtype) for x in (q64, k64, v64))
    if bshd:  # BSHD storage, passed as such
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    m = mask if mask is None or mask.dtype == torch.bool else mask.to(torch.float32)
    o = qkv.attention(q, k, v, scale=scale, softcap=softcap, causal=opts.get("causal", False),
                      align="top-left" if opts.get("top_left") else "bottom-right",
                      window=opts.get("window", (-1, -1)), mask=m, kv_lens=kv_lens,
                      layout="bshd" if bshd else "bhsd")
    assert o.dtype == dtype
    do = do64.to(dtype)
    o.backward(do.transpose(1, 2) if bshd else do)
    ours = [o, q.grad, k.grad, v.grad]
    if bshd:
        ours = [x.transpose(1, 2) for x in ours]
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, low, ref):
        assert a.shape == r.shape, name
        assert_within_rule(name, a, b, r, dtype)


def test_numpy_forward_and_backward_match_torch():
    """The NumPy entry points give the same numbers as the PyTorch ones (same kernels)."""
    q, k, v = (torch.randn(2, 4, 19, 32) for _ in range(3))
    o_t, lse_t = qkv.attention(q, k, v, causal=True, return_lse=True)
    o_n, lse_n = qkv.attention(q.numpy(), k.numpy(), v.numpy(), causal=True, return_lse=True)
    assert (o_t.numpy() == o_n).all() and (lse_t.numpy() == lse_n).all()
    do = torch.randn_like(o_t)
    g_n = qkv.attention_backward(q.numpy(), k.numpy(), v.numpy(), o_n, lse_n, do.numpy(), causal=True)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    qkv.attention(qq, kk, vv, causal=True).backward(do)
    for a, b in zip(g_n, (qq.grad, kk.grad, vv.grad)):
        assert (a == b.numpy()).all()


def test_float16_numpy_and_lse():
    import numpy as np
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 9, 16)).astype(np.float16) for _ in range(3))
    out, lse = qkv.attention(q, k, v, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32 and lse.shape == (1, 2, 9)
    ref = reference(*(torch.from_numpy(x.astype(np.float64)) for x in (q, k, v)))
    assert np.abs(out.astype(np.float64) - ref.numpy()).max() < 2e-3
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)) / 4.0
    assert np.abs(lse - np.log(np.exp(s).sum(-1))).max() < 1e-4


def test_return_probs_and_reference_kernel():
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    out, lse, probs = qkv.attention(q, k, v, causal=True, return_lse=True, return_probs=True, kernel="reference")
    add = option_mask(1, 2, 5, 5, causal=True)
    p = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5 + add, -1)
    assert torch.allclose(probs, p, atol=1e-12) and torch.allclose(out, p @ v, atol=1e-12)
    assert "reference" in qkv.explain_dispatch(q, k, v, kernel="reference")


def test_explain_dispatch_of_the_backward():
    # The backward's choice is explained as the forward's: flash for float32 (also BSHD tensors that
    # require grad), the reference for float64 and when forced; nothing is computed.
    q = np.random.default_rng(3).standard_normal((1, 4, 40, 16)).astype(np.float32)
    text = qkv.explain_dispatch(q, q, q, causal=True, backward=True)
    assert text.splitlines()[0].startswith("flash: chosen") and "decode" not in text
    t = torch.randn(1, 40, 4, 16, requires_grad=True)
    assert qkv.explain_dispatch(t, t, t, layout="bshd", backward=True).startswith("flash: chosen")
    d = q.astype(np.float64)
    assert "flash: refused (float64" in qkv.explain_dispatch(d, d, d, backward=True)
    assert "reference: chosen" in qkv.explain_dispatch(q, q, q, kernel="reference", backward=True)
    with pytest.raises(ValueError, match="decode"):
        qkv.explain_dispatch(q, q, q, kernel="decode", backward=True)
    with pytest.raises(TypeError, match="backward"):
        qkv.explain_dispatch(q, q, q, backward="yes")
