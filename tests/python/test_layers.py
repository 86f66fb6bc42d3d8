"""qkv.MultiHeadAttention (loaded from torch.nn.MultiheadAttention), qkv.KVCache decoding, and
qkv.explain's five steps."""
import numpy as np
import pytest
import torch

import qkv


@pytest.mark.parametrize("bias", [True, False])
def test_mha_matches_torch_multihead_attention(bias):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(32, 4, bias=bias, batch_first=True).double()
    layer = qkv.MultiHeadAttention.from_torch(ref)
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    causal = torch.triu(torch.ones(11, 11, dtype=torch.bool), 1)  # True = ignore (PyTorch's polarity)
    with torch.no_grad():
        y_ref, _ = ref(x, x, x, need_weights=False)
        y_ref_c, _ = ref(x, x, x, attn_mask=causal, need_weights=False)
    y = layer(x.float())
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    assert (y.double() - y_ref).abs().max() < 1e-5
    y_c = layer(x.float().numpy(), causal=True)
    assert isinstance(y_c, np.ndarray) and np.abs(y_c - y_ref_c.numpy()).max() < 1e-5
    kv = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        y_x, _ = ref(x, kv, kv, need_weights=False)
    assert (layer(x.float(), kv.float()).double() - y_x).abs().max() < 1e-5


def test_mha_from_torch_refuses_what_it_does_not_compute():
    # extra key/value rows (bias_k, bias_v; a zero row) that the layer does not append: refused,
    # never loaded into a layer that silently computes something else
    for kw, name in (({"add_bias_kv": True}, "add_bias_kv"), ({"add_zero_attn": True}, "add_zero_attn")):
        ref = torch.nn.MultiheadAttention(16, 4, batch_first=True, **kw)
        with pytest.raises(NotImplementedError, match=name):
            qkv.MultiHeadAttention.from_torch(ref)
    ref = torch.nn.MultiheadAttention(16, 4, batch_first=True, add_bias_kv=True)
    with pytest.raises(NotImplementedError, match="bias_k"):
        qkv.MultiHeadAttention(16, 4).load_state_dict(ref.state_dict())


def test_kv_cache_decoding_equals_full_causal_attention():
    torch.manual_seed(1)
    layer = qkv.MultiHeadAttention(32, 4, num_kv_heads=2, rope="half")
    layer.load_state_dict({n: torch.randn(w.shape) * 0.2 for n, w in
                           {"q_proj.weight": torch.empty(32, 32), "k_proj.weight": torch.empty(16, 32),
                            "v_proj.weight": torch.empty(16, 32), "o_proj.weight": torch.empty(32, 32),
                            "q_proj.bias": torch.empty(32), "k_proj.bias": torch.empty(16),
                            "v_proj.bias": torch.empty(16), "o_proj.bias": torch.empty(32)}.items()})
    x = torch.randn(1, 9, 32)
    full = layer(x, causal=True)
    cache = qkv.KVCache(1, 2, 16, 8)
    steps = [layer(x[:, :5], cache=cache, causal=True)]
    for t in range(5, 9):
        steps.append(layer(x[:, t:t + 1], cache=cache, causal=True))
    assert cache.lengths == [9]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5


def test_kv_cache_attend_gqa_decode():
    cache = qkv.KVCache(2, 2, 64, 16, dtype="bfloat16")
    k, v = torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    cache.append(k, v)
    q = torch.randn(2, 8, 1, 16)
    out = cache.attend(q)
    ref = qkv.attention(q, k.bfloat16().float(), v.bfloat16().float())
    assert out.shape == (2, 8, 1, 16) and (out - ref).abs().max() < 1e-5
    with pytest.raises(ValueError):
        cache.append(torch.randn(2, 2, 30, 16), torch.randn(2, 2, 30, 16))  # beyond the capacity
    assert cache.lengths == [40, 40]


def test_explain_five_steps():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    steps = qkv.explain(q, k, v, causal=True)
    s = np.einsum("bhid,bhjd->bhij", q, k)
    adm = np.tril(np.ones((5, 5), bool))
    assert np.allclose(steps["scores"][..., adm], s[..., adm]) and np.isneginf(steps["scores"][..., ~adm]).all()
    assert np.allclose(steps["scaled"][..., adm], s[..., adm] / 2.0)
    assert (steps["status"][..., ~adm] == 1).all() and (steps["status"][..., adm] == 0).all()
    assert np.allclose(steps["weights"].sum(-1), 1.0)
    assert np.allclose(steps["output"], steps["weights"] @ v)
    assert np.allclose(steps["output"], qkv.attention(q, k, v, causal=True), atol=1e-12)
    assert steps["scale"] == 0.5 and steps["window"] == (-1, 0)
