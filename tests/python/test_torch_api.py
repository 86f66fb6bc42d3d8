"""The PyTorch entry points: SDPA and flash_attn_func semantics, the custom operator under
torch.compile(fullgraph=True), and a small model trained the same way compiled and eager."""
import math

import numpy as np

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import qkv
import qkv.torch as qt
from conftest import option_mask, reference


def sdpa64(*args, **kw):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*(a.double() for a in args), **kw)


@pytest.mark.parametrize("kw", [
    {}, {"is_causal": True}, {"scale": 0.2}, {"attn_mask": "bool"}, {"attn_mask": "float"},
    {"enable_gqa": True}, {"is_causal": True, "enable_gqa": True},
])
def test_sdpa_semantics(kw):
    kw = dict(kw)
    Hkv = 2 if kw.get("enable_gqa") else 4
    q = torch.randn(2, 4, 12, 16)
    k, v = torch.randn(2, Hkv, 20, 16), torch.randn(2, Hkv, 20, 8)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(12, 20) < 0.5
        kw["attn_mask"][:, 0] = True
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(1, 4, 12, 20)
    ours = qt.scaled_dot_product_attention(q, k, v, **kw)
    ref = sdpa64(q, k, v, **kw)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert (ours.double() - ref).abs().max() < 1e-5


def test_sdpa_3d_and_errors():
    q, k, v = torch.randn(3, 5, 8), torch.randn(3, 7, 8), torch.randn(3, 7, 8)
    assert (qt.scaled_dot_product_attention(q, k, v).double() - sdpa64(q, k, v)).abs().max() < 1e-5
    with pytest.raises(NotImplementedError, match="dropout_p"):
        qt.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="enable_gqa"):
        qt.scaled_dot_product_attention(torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))


def test_sdpa_masks_of_the_query_dtype_and_masks_that_require_grad():
    # a float mask in bf16 / fp16 (PyTorch accepts one of the query's dtype) is taken exactly
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(1, 2, 5, 8).to(dtype)
        m = torch.randn(5, 5).to(dtype)
        ours = qt.scaled_dot_product_attention(q, q, q, attn_mask=m)
        assert ours.dtype == dtype
        ref = sdpa64(q, q, q, attn_mask=m.double())
        # within twice PyTorch's own error in this dtype, plus a floor of the dtype's rounding
        err = (F.scaled_dot_product_attention(q, q, q, attn_mask=m).double() - ref).abs().max()
        assert (ours.double() - ref).abs().max() <= 2 * err + 1e-2
    # as PyTorch, only a mask of the query's dtype is taken (a bf16 mask on float32 queries is not)
    with pytest.raises(ValueError, match="mask"):
        qt.scaled_dot_product_attention(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
                                        attn_mask=torch.randn(5, 5).bfloat16())
    # a mask that requires grad would get none: refused by name
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    mb = torch.randn(1, 2, 5, 5, requires_grad=True)
    with pytest.raises(NotImplementedError, match="attn_mask: qkv computes no gradient"):
        qt.scaled_dot_product_attention(q, q, q, attn_mask=mb)
    out = qt.scaled_dot_product_attention(q, q, q, attn_mask=mb.detach())
    out.sum().backward()
    assert q.grad is not None


def test_option_types_at_every_entry_point():
    b = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="window_size: expected a pair of integers"):
        qkv.flash_attn_func(b, b, b, window_size=(1.7, 0))
    with pytest.raises(TypeError, match="causal: expected a bool"):
        qkv.flash_attn_func(b, b, b, causal="no")
    with pytest.raises(TypeError, match="softmax_scale: expected a real number"):
        qkv.flash_attn_func(b, b, b, softmax_scale="0.5")
    with pytest.raises(TypeError, match="is_causal: expected a bool"):
        qt.scaled_dot_product_attention(b, b, b, is_causal="yes")
    with pytest.raises(TypeError, match="enable_gqa: expected a bool"):  # PyTorch refuses "no" too
        qt.scaled_dot_product_attention(b, torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), enable_gqa="no")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="causal: expected a bool"):
        qkv.explain(q, q, q, causal="no")
    with pytest.raises(TypeError, match="scale: expected a real number"):
        qkv.explain(q, q, q, scale="x")
    out, lse = qkv.attention(q, q, q, return_lse=True)
    with pytest.raises(TypeError, match="softcap: expected a real number"):
        qkv.attention_backward(q, q, q, out, lse, torch.ones_like(out), softcap="1")
    with pytest.raises(TypeError, match="causal: expected a bool"):
        qkv.explain_dispatch(q, q, q, causal=2)
    # grad_dtype: None, float32, float64 or q's dtype, as the framework's dtype or by name
    g = torch.ones_like(out)
    for gd, want in ((None, torch.float32), ("float64", torch.float64), (torch.float64, torch.float64),
                     ("float32", torch.float32)):
        assert qkv.attention_backward(q, q, q, out, lse, g, grad_dtype=gd)[0].dtype == want, gd
    assert qkv.attention_backward(q.numpy(), q.numpy(), q.numpy(), out.numpy(), lse.numpy(), g.numpy(),
                                  grad_dtype="float64")[0].dtype == np.float64
    for gd, err in (("float16", ValueError), (torch.bfloat16, ValueError), ("f64", ValueError), (3, TypeError)):
        with pytest.raises(err, match="grad_dtype: expected None, float32, float64 or q's dtype"):
            qkv.attention_backward(q, q, q, out, lse, g, grad_dtype=gd)
    with pytest.raises(TypeError, match="grad_dtype: expected None, float32, float64 or q's dtype"):
        qkv.attention_backward(q.numpy(), q.numpy(), q.numpy(), out.numpy(), lse.numpy(), g.numpy(),
                               grad_dtype=torch.float64)
    layer = qkv.MultiHeadAttention(16, 4)
    with pytest.raises(TypeError, match="scale: expected a real number"):
        layer(torch.randn(1, 3, 16), scale="x")
    cache = qkv.KVCache(1, 2, 8, 8)
    with pytest.raises(ValueError, match="window: expected a pair of integers"):
        cache.attend(q, window=(0.5, 0))
    # what is taken: NumPy and 0-d scalars, integers, NumPy bools, 0/1, integer windows of any kind
    base = qkv.attention(q, q, q, scale=0.5, causal=True, window=(2, 0), softcap=0.0)
    for kw in ({"scale": np.float32(0.5)}, {"scale": torch.tensor(0.5)}, {"scale": np.array(0.5)},
               {"causal": np.bool_(True)}, {"causal": 1}, {"window": [2, 0]}, {"window": np.array([2, 0])},
               {"window": (torch.tensor(2), np.int64(0))}, {"softcap": 0}):
        args = {"scale": 0.5, "causal": True, "window": (2, 0), "softcap": 0.0, **kw}
        assert torch.equal(qkv.attention(q, q, q, **args), base), kw
    # a mask that requires grad is refused only where gradients flow: the others detach it
    p = torch.nn.Parameter(torch.zeros(4, 4))
    assert qkv.explain(q, q, q, mask=p)["output"].shape == (1, 2, 4, 8)
    qkv.attention_backward(q, q, q, out, lse, torch.ones_like(out), mask=p)
    layer(torch.randn(1, 3, 16), mask=torch.nn.Parameter(torch.zeros(3, 3)))


def test_flash_attn_func_semantics():
    B, Sq, Sk, Hq, Hkv, D = 2, 7, 19, 4, 2, 16
    q, k, v = torch.randn(B, Sq, Hq, D), torch.randn(B, Sk, Hkv, D), torch.randn(B, Sk, Hkv, D)
    out, lse, probs = qkv.flash_attn_func(q, k, v, causal=True, window_size=(5, -1), softcap=3.0,
                                          return_attn_probs=True)
    assert probs is None and out.shape == (B, Sq, Hq, D) and lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32
    add = option_mask(B, Hq, Sq, Sk, causal=True, window=(5, -1))  # bottom-right
    qb, kb, vb = (x.transpose(1, 2).double() for x in (q, k, v))
    ref = reference(qb, kb, vb, softcap=3.0, add=add).transpose(1, 2)
    assert (out.double() - ref).abs().max() < 1e-5
    rep = Hq // Hkv
    s = qb @ kb.repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(D)
    s = 3.0 * torch.tanh(s / 3.0) + add
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max() < 1e-5
    with pytest.raises(NotImplementedError, match="dropout_p"):
        qkv.flash_attn_func(q, k, v, dropout_p=0.5)
    # ALiBi runs (tests/python/test_score_options.py checks its values); slopes that require grad
    # would get no gradient, and are refused where the call is differentiable
    assert qkv.flash_attn_func(q, k, v, alibi_slopes=torch.ones(Hq)).shape == (B, Sq, Hq, D)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        qkv.flash_attn_func(q.requires_grad_(), k, v, alibi_slopes=torch.ones(Hq, requires_grad=True))


def test_custom_op_is_registered_and_fake_shapes():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 6)
    torch.library.opcheck(torch.ops.qkv.attention.default, (q, k, v),
                          {"scale": 0.5, "causal": True, "window_left": 3, "softcap": 2.0})
    torch.library.opcheck(torch.ops.qkv.attention.default, (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            None, torch.tensor([4])), {"layout": "bshd"})
    out, lse = torch.ops.qkv.attention(q, k, v, causal=True)
    torch.library.opcheck(torch.ops.qkv.attention_backward.default, (torch.randn_like(out), q, k, v, out, lse),
                          {"causal": True})


class TinyModel(torch.nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv_proj = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x):
        B, S, d = x.shape
        q, k, v = self.qkv_proj(x).view(B, S, 3, self.heads, d // self.heads).unbind(2)  # BSHD views
        o = qkv.flash_attn_func(q, k, v, causal=True)
        return self.out(o.reshape(B, S, d))


def train(model, steps, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_training_under_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    x, y = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    eager = TinyModel()
    compiled = TinyModel()
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    cfn = torch.compile(compiled, fullgraph=True)
    le = train(eager, 4, x, y)
    lc = train(cfn, 4, x, y)
    assert le[-1] < le[0]
    for a, b in zip(le, lc):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (le, lc)
