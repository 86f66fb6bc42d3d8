"""torch.autograd.gradcheck (float64 central differences against qkv's analytic backward) on small
shapes, one case per option of the C++ API."""
import pytest
import torch

import qkv

OPTIONS = {
    "plain": {},
    "causal_bottom_right": {"causal": True},
    "causal_top_left": {"causal": True, "align": "top-left"},
    "window": {"window": (1, 1)},
    "window_causal_top_left": {"window": (2, 0), "align": "top-left"},
    "softcap": {"softcap": 1.5},
    "scale": {"scale": 0.7},
    "bool_mask": {"mask": "bool"},
    "float_mask": {"mask": "float"},
    "kv_lens": {"kv_lens": [5, 3]},
    "gqa": {"gqa": True},
    "bshd": {"layout": "bshd"},
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_gradcheck(name):
    opts = dict(OPTIONS[name])
    B, Hq, Sq, Sk, D = 2, 2, 4, 5, 3
    Hkv = 1 if opts.pop("gqa", False) else Hq
    bshd = opts.get("layout") == "bshd"
    shape = (lambda H, S, d: (B, S, H, d)) if bshd else (lambda H, S, d: (B, H, S, d))
    q = torch.randn(*shape(Hq, Sq, D), dtype=torch.float64, requires_grad=True)
    k = torch.randn(*shape(Hkv, Sk, D), dtype=torch.float64, requires_grad=True)
    v = torch.randn(*shape(Hkv, Sk, D + 1), dtype=torch.float64, requires_grad=True)
    if opts.get("mask") == "bool":
        opts["mask"] = torch.rand(B, 1, Sq, Sk) < 0.6
        opts["mask"][..., 0] = True
    elif opts.get("mask") == "float":
        opts["mask"] = torch.randn(1, Hq, Sq, Sk, dtype=torch.float64)
    if "kv_lens" in opts:
        opts["kv_lens"] = torch.tensor(opts["kv_lens"], dtype=torch.int64)
    assert torch.autograd.gradcheck(lambda q, k, v: qkv.attention(q, k, v, **opts), (q, k, v), eps=1e-6,
                                    atol=1e-7, rtol=1e-5)


def test_gradcheck_sdpa_and_flash_attn_func():
    q, k, v = (torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(
        lambda q, k, v: qkv.torch.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: qkv.flash_attn_func(q, k, v, causal=True, softcap=2.0), (q, k, v))
