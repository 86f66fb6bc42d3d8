"""Shared helpers of the Python package tests: the float64 PyTorch reference and the error rule.

The reference is PyTorch's own scaled_dot_product_attention on its math backend, with every qkv
option lowered to an additive mask (alignment, window, key lengths, bool/float masks) and GQA by
enable_gqa; softcap, which SDPA lacks, runs the same math written out (scores, tanh, softmax).
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def option_mask(B, Hq, Sq, Sk, *, causal=False, top_left=False, window=(-1, -1), kv_lens=None, mask=None,
                dtype=torch.float64):
    """The additive mask [B, Hq, Sq, Sk] (0 or -inf, plus a float mask) equal to qkv's options."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    i = torch.arange(Sq).view(Sq, 1)
    j = torch.arange(Sk).view(1, Sk)
    add = torch.zeros(B, Hq, Sq, Sk, dtype=dtype)
    for b in range(B):
        sk_b = Sk if kv_lens is None else int(kv_lens[b])
        diag = i if top_left else i + sk_b - Sq
        ok = j < sk_b
        if left >= 0:
            ok = ok & (j >= diag - left)
        if right >= 0:
            ok = ok & (j <= diag + right)
        add[b] = add[b].masked_fill(~ok, float("-inf"))
    if mask is not None:
        if mask.dtype == torch.bool:
            add = add.masked_fill(~mask.expand(B, Hq, Sq, Sk), float("-inf"))
        else:
            add = add + mask.to(dtype)
    return add


def reference(q, k, v, *, scale=None, softcap=0.0, add=None):
    """PyTorch's attention in q's dtype: SDPA (math backend) with an additive mask, or with softcap
    the same math written out. q, k, v are BHSD; Hq % Hkv == 0."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    gqa = q.shape[1] != k.shape[1]
    m = None if add is None else add.to(q.dtype)
    if softcap == 0.0:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale, enable_gqa=gqa)
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    s = softcap * torch.tanh(s / softcap)
    if m is not None:
        s = s + m
    return torch.softmax(s.float() if q.dtype in (torch.bfloat16, torch.float16) else s, -1).to(q.dtype) @ vv


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


FLOOR = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 1e-3}


def assert_within_rule(name, ours, torch_low, ref64, dtype):
    """FlashAttention's rule: qkv's error <= 2 x PyTorch's low-precision error, plus a floor."""
    e_ours, e_torch = max_err(ours, ref64), max_err(torch_low, ref64)
    bound = 2.0 * e_torch + FLOOR[dtype]
    assert e_ours <= bound, f"{name}: qkv error {e_ours:.3g} > 2 x torch {e_torch:.3g} + {FLOOR[dtype]:g}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
