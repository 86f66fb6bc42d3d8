"""The score options sinks, alibi_slopes and keep_first in the Python package: qkv.attention (NumPy
and PyTorch), attention_backward (dsinks), autograd and gradcheck of the sinks, the drop-in
PyTorch functions, the custom operators (opcheck, torch.compile), qkv.alibi_slopes, the layer,
and the errors. The expected values come from the formulas written here in NumPy float64:

  s_ij = softcap(scale q_i.k_j) - slope_h |i + offset - j|     (offset: the diagonal's)
  admissible j: j < len_b, right of the window's left side or j < keep_first, left of its right side
  p_ij = exp(s_ij) / (exp(z_h) + sum_j exp(s_ij)),  O_i = sum_j p_ij v_j,  lse_i = log(denominator)
  d z_h = -sum over b, i of exp(z_h - lse_i) * rowsum(dO_i * O_i)

Shapes are small: in this version the float64 reference kernel computes these options."""
import math

import numpy as np
import pytest
import torch

import qkv


def admissible(B, Sq, Sk, *, causal=False, top_left=False, window=(-1, -1), keep_first=0, kv_lens=None):
    """bool [B, 1, Sq, Sk]: the keys each query may attend (qkv's options, docs/semantics.md)."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    i = np.arange(Sq)[:, None]
    j = np.arange(Sk)[None, :]
    ok = np.zeros((B, 1, Sq, Sk), dtype=bool)
    for b in range(B):
        n = Sk if kv_lens is None else int(kv_lens[b])
        diag = i if top_left else i + n - Sq
        left_ok = j >= diag - left if left >= 0 else np.ones((Sq, Sk), dtype=bool)
        right_ok = j <= diag + right if right >= 0 else np.ones((Sq, Sk), dtype=bool)
        ok[b, 0] = (left_ok | (j < keep_first)) & right_ok & (j < n)  # keep_first widens the left side only
    return ok


def alibi_bias(slopes, B, Hq, Sq, Sk, *, top_left=False, kv_lens=None):
    """float64 [B, Hq, Sq, Sk]: -slope_h |i + offset - j|, slopes [Hq] or [B, Hq]."""
    slopes = np.asarray(slopes, dtype=np.float64)
    slopes = np.broadcast_to(slopes if slopes.ndim == 2 else slopes[None], (B, Hq))
    i = np.arange(Sq)[:, None]
    j = np.arange(Sk)[None, :]
    bias = np.zeros((B, Hq, Sq, Sk))
    for b in range(B):
        n = Sk if kv_lens is None else int(kv_lens[b])
        diag = i if top_left else i + n - Sq
        bias[b] = -slopes[b][:, None, None] * np.abs(diag - j)[None]
    return bias


def scores(q, k, *, scale=None, softcap=0.0, alibi=None, top_left=False, kv_lens=None):
    """float64 scores [B, Hq, Sq, Sk] before the masks (GQA: each KV head repeated)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    k = np.repeat(k, Hq // k.shape[1], axis=1)
    s = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(D) if scale is None else scale)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if alibi is not None:
        s = s + alibi_bias(alibi, B, Hq, Sq, Sk, top_left=top_left, kv_lens=kv_lens)
    return s


def reference(q, k, v, *, sinks=None, alibi=None, scale=None, softcap=0.0, causal=False, top_left=False,
              window=(-1, -1), keep_first=0, kv_lens=None):
    """(out, lse, p_sink) in float64 NumPy: the formulas of the module docstring."""
    B, Hq, Sq, _ = q.shape
    Sk = k.shape[2]
    s = scores(q, k, scale=scale, softcap=softcap, alibi=alibi, top_left=top_left, kv_lens=kv_lens)
    ok = admissible(B, Sq, Sk, causal=causal, top_left=top_left, window=window, keep_first=keep_first,
                    kv_lens=kv_lens)
    s = np.where(ok, s, -np.inf)
    z = np.full(Hq, -np.inf) if sinks is None else np.asarray(sinks, np.float64)
    zb = np.broadcast_to(z[None, :, None], (B, Hq, Sq))
    m = np.maximum(s.max(-1, initial=-np.inf), zb)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m[..., None])
    denom = e.sum(-1) + np.exp(zb - m)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(denom[..., None] > 0, e / denom[..., None], 0.0)
        lse = np.log(denom) + m
        p_sink = np.where(denom > 0, np.exp(zb - m) / denom, 0.0)
    vv = np.repeat(np.asarray(v, np.float64), Hq // v.shape[1], axis=1)
    return p @ vv, lse, p_sink


def eager(q, k, v, *, sinks=None, alibi=None, scale=None, causal=False, top_left=False, window=(-1, -1),
          keep_first=0):
    """The same formulas as PyTorch operations (differentiable in q, k, v and the sinks), BHSD."""
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    rep = Hq // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ kk.transpose(-1, -2)) * (1.0 / math.sqrt(D) if scale is None else scale)
    if alibi is not None:
        s = s + torch.from_numpy(alibi_bias(alibi, B, Hq, Sq, Sk, top_left=top_left)).to(s.dtype)
    ok = torch.from_numpy(admissible(B, Sq, Sk, causal=causal, top_left=top_left, window=window,
                                     keep_first=keep_first))
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        z = sinks.to(s.dtype).view(1, Hq, 1, 1).expand(B, Hq, Sq, 1)
        p = torch.softmax(torch.cat([s, z], -1), -1)[..., :Sk]
    else:
        p = torch.softmax(s, -1)
    return p @ vv


def rand(*shape, seed, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


CASES = {
    "sinks": dict(sinks=True),
    "sinks_causal_gqa": dict(sinks=True, causal=True, Hkv=1),
    "sinks_window_keep_first": dict(sinks=True, window=(2, 0), keep_first=2),
    "alibi": dict(alibi="heads"),
    "alibi_per_batch_causal": dict(alibi="batch", causal=True),
    "alibi_top_left_softcap": dict(alibi="heads", causal=True, top_left=True, softcap=2.0),
    "keep_first_window": dict(window=(1, 0), keep_first=3),
    "keep_first_window_top_left": dict(window=(2, 1), keep_first=1, top_left=True),
    "all_three_kv_lens": dict(sinks=True, alibi="heads", window=(3, 0), keep_first=2, kv_lens=True),
    "all_three_sq_gt_sk": dict(sinks=True, alibi="batch", causal=True, keep_first=1, Sq=9, Sk=5),
}


def case_arrays(c, dtype, seed=0):
    B, Hq, Sq, Sk, D = 2, 4, c.get("Sq", 6), c.get("Sk", 11), 8
    Hkv = c.get("Hkv", 2)
    q, k, v = rand(B, Hq, Sq, D, seed=seed, dtype=dtype), rand(B, Hkv, Sk, D, seed=seed + 1, dtype=dtype), \
        rand(B, Hkv, Sk, D + 3, seed=seed + 2, dtype=dtype)
    opts, ref = {}, {}
    if c.get("sinks"):
        opts["sinks"] = ref["sinks"] = rand(Hq, seed=seed + 3)
    if c.get("alibi") == "heads":
        opts["alibi_slopes"] = ref["alibi"] = qkv.alibi_slopes(Hq)
    elif c.get("alibi") == "batch":
        opts["alibi_slopes"] = ref["alibi"] = np.abs(rand(B, Hq, seed=seed + 4))
    for name in ("causal", "window", "keep_first", "softcap"):
        if name in c:
            opts[name] = ref[name] = c[name]
    if c.get("top_left"):
        opts["align"], ref["top_left"] = "top-left", True
    if c.get("kv_lens"):
        opts["kv_lens"] = ref["kv_lens"] = np.array([Sk, Sk - 4], dtype=np.int64)
    return (q, k, v), opts, ref


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_matches_the_formulas(name, dtype):
    (q, k, v), opts, ref = case_arrays(CASES[name], dtype)
    out, lse = qkv.attention(q, k, v, return_lse=True, **opts)
    want, want_lse, _ = reference(q, k, v, **ref)
    tol = 1e-12 if dtype == np.float64 else 2e-6
    assert out.dtype == dtype and np.abs(out - want).max() <= tol * max(1.0, np.abs(want).max())
    assert np.allclose(lse, want_lse, rtol=0, atol=tol * 10)
    # BSHD views of the same arrays give the same bits
    t = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    out_bshd = qkv.attention(t(q), t(k), t(v), layout="bshd", **opts)
    assert np.array_equal(t(out_bshd), out)


def test_a_row_without_keys_gives_zero_and_lse_the_sink():
    B, Hq, Sq, Sk, D = 2, 3, 4, 5, 8
    q, k, v = rand(B, Hq, Sq, D, seed=1), rand(B, Hq, Sk, D, seed=2), rand(B, Hq, Sk, D, seed=3)
    sinks = np.array([0.5, -1.0, 2.0], dtype=np.float32)
    out, lse = qkv.attention(q, k, v, sinks=sinks, kv_lens=np.array([0, 5], dtype=np.int64), return_lse=True)
    assert np.all(out[0] == 0) and np.array_equal(lse[0], np.broadcast_to(sinks[:, None], (Hq, Sq)))
    want, want_lse, _ = reference(q, k, v, sinks=sinks, kv_lens=[0, 5])
    assert np.abs(out[1] - want[1]).max() < 2e-6 and np.abs(lse[1] - want_lse[1]).max() < 2e-6


def test_sinks_lower_every_weight_and_keep_the_rows_convex():
    # exp(z) joins the denominator: out = (1 - p_sink) * (the plain softmax's out)
    q, k, v = rand(1, 2, 3, 4, seed=5, dtype=np.float64), rand(1, 2, 6, 4, seed=6, dtype=np.float64), \
        rand(1, 2, 6, 4, seed=7, dtype=np.float64)
    sinks = np.array([1.0, -3.0], dtype=np.float32)
    plain = qkv.attention(q, k, v)
    with_sinks = qkv.attention(q, k, v, sinks=sinks)
    _, _, p_sink = reference(q, k, v, sinks=sinks)
    assert np.abs(with_sinks - (1 - p_sink[..., None]) * plain).max() < 1e-12


@pytest.mark.parametrize("name", ["sinks", "sinks_causal_gqa", "all_three_kv_lens", "all_three_sq_gt_sk"])
def test_attention_backward_returns_dsinks(name):
    (q, k, v), opts, ref = case_arrays(CASES[name], np.float64, seed=10)
    out, lse = qkv.attention(q, k, v, return_lse=True, **opts)
    do = rand(*out.shape, seed=20, dtype=np.float64)
    grads = qkv.attention_backward(q, k, v, out, lse, do, **opts)
    assert len(grads) == 4
    dq, dk, dv, dsinks = grads
    assert dsinks.shape == (q.shape[1],) and dsinks.dtype == np.float32
    want_out, _, p_sink = reference(q, k, v, **ref)
    want = -(p_sink * (do * want_out).sum(-1)).sum((0, 2))
    assert np.abs(dsinks - want).max() <= 1e-6 * max(1.0, np.abs(want).max())
    # dq, dk, dv against PyTorch's autograd of the eager formula (no kv_lens there: refer to those cases)
    if "kv_lens" not in opts:
        qt, kt, vt = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
        zt = torch.from_numpy(opts["sinks"].astype(np.float64)).requires_grad_()
        eo = {n: ref[n] for n in ("causal", "top_left", "window", "keep_first", "alibi") if n in ref}
        eager(qt, kt, vt, sinks=zt, **eo).backward(torch.from_numpy(do))
        for got, t in zip((dq, dk, dv, dsinks), (qt, kt, vt, zt)):
            assert np.abs(got - t.grad.numpy()).max() <= 1e-6 * max(1.0, t.grad.abs().max().item())
    # without sinks: the three gradients only
    plain = {n: x for n, x in opts.items() if n != "sinks"}
    out, lse = qkv.attention(q, k, v, return_lse=True, **plain)
    assert len(qkv.attention_backward(q, k, v, out, lse, do, **plain)) == 3


ALIBI8 = 2.0 ** -np.arange(1, 9)


def bloom_slopes(n):
    """BLOOM's build_alibi_tensor slopes, written from the paper's rule (Press et al. 2022, sec. 3)."""
    p = 2 ** int(math.floor(math.log2(n)))
    slopes = [2.0 ** (-8.0 * (h + 1) / p) for h in range(p)]
    slopes += [2.0 ** (-4.0 * (2 * h + 1) / p) for h in range(n - p)]
    return np.array(slopes)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 12, 16, 30])
def test_alibi_slopes_are_bloom_s(n):
    s = qkv.alibi_slopes(n)
    assert s.dtype == np.float32 and s.shape == (n,)
    assert np.abs(s - bloom_slopes(n)).max() <= 1e-7
    if n == 8:
        assert np.array_equal(s, ALIBI8.astype(np.float32))


def test_errors_name_the_argument():
    q = k = v = rand(1, 2, 3, 4, seed=0)
    with pytest.raises(ValueError, match="sinks"):
        qkv.attention(q, k, v, sinks=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="sinks"):
        qkv.attention(q, k, v, sinks=np.zeros((1, 2), np.float32))
    with pytest.raises(TypeError, match="sinks"):
        qkv.attention(q, k, v, sinks=np.zeros(2, np.int64))
    with pytest.raises(TypeError, match="sinks: expected dtype float32"):
        qkv.attention(q, k, v, sinks=np.zeros(2, np.float64))
    with pytest.raises(TypeError, match="sinks"):
        qkv.attention(q, k, v, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="alibi_slopes"):
        qkv.attention(q, k, v, alibi_slopes=np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="alibi_slopes"):
        qkv.attention(q, k, v, alibi_slopes=np.zeros((2, 2), np.float32))
    with pytest.raises(TypeError, match="alibi_slopes"):
        qkv.attention(q, k, v, alibi_slopes=[0.5, 0.25])
    with pytest.raises(ValueError, match="keep_first"):
        qkv.attention(q, k, v, window=(1, 0), keep_first=-1)
    with pytest.raises(TypeError, match="keep_first"):
        qkv.attention(q, k, v, window=(1, 0), keep_first=1.5)
    with pytest.raises(TypeError, match="keep_first"):
        qkv.attention(q, k, v, window=(1, 0), keep_first=True)
    with pytest.raises(TypeError, match="keep_firts.*keep_first"):
        qkv.attention(q, k, v, keep_firts=1)
    with pytest.raises(ValueError, match="num_heads"):
        qkv.alibi_slopes(-1)
    assert qkv.alibi_slopes(0).shape == (0,)
    with pytest.raises(TypeError, match="num_heads"):
        qkv.alibi_slopes(2.0)
    t = torch.from_numpy(q).requires_grad_()
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        qkv.attention(t, t, t, alibi_slopes=torch.ones(2, requires_grad=True))


def test_numpy_and_torch_agree_and_keep_first_numpy_integers():
    (q, k, v), opts, _ = case_arrays(CASES["all_three_sq_gt_sk"], np.float32)
    a = qkv.attention(q, k, v, **opts)
    topts = {n: torch.from_numpy(x) if isinstance(x, np.ndarray) else x for n, x in opts.items()}
    b = qkv.attention(*(torch.from_numpy(x) for x in (q, k, v)), **topts)
    assert np.array_equal(a, b.numpy())
    c = qkv.attention(q, k, v, **{**opts, "keep_first": np.int64(opts["keep_first"])})
    assert np.array_equal(a, c)


# ---------------------------------------------------------------- PyTorch: autograd, drop-ins, operators


def t64(*shape, seed):
    return torch.from_numpy(rand(*shape, seed=seed, dtype=np.float64))


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(2, 0), keep_first=1),
                                dict(alibi_slopes=True, causal=True)], ids=["plain", "causal", "keep_first", "alibi"])
def test_sinks_autograd_matches_torch_autograd_of_the_formula(kw):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 5, 7, 8
    q, k, v = t64(B, Hq, Sq, D, seed=1), t64(B, Hkv, Sk, D, seed=2), t64(B, Hkv, Sk, D, seed=3)
    z = torch.tensor([0.3, -1.0, 1.5, 0.0], dtype=torch.float32)
    kw = dict(kw)
    eo = {n: kw[n] for n in ("causal", "window", "keep_first") if n in kw}
    if kw.pop("alibi_slopes", False):
        kw["alibi_slopes"] = torch.from_numpy(qkv.alibi_slopes(Hq))
        eo["alibi"] = qkv.alibi_slopes(Hq)
    do = t64(B, Hq, Sq, D, seed=4)
    ins = [x.clone().requires_grad_() for x in (q, k, v, z)]
    qkv.attention(*ins[:3], sinks=ins[3], **kw).backward(do)
    ref = [x.clone().requires_grad_() for x in (q, k, v, z.double())]
    eager(*ref[:3], sinks=ref[3], **eo).backward(do)
    for a, b in zip(ins, ref):
        assert a.grad.dtype == a.dtype
        assert (a.grad.double() - b.grad).abs().max() <= 1e-6 * max(1.0, b.grad.abs().max().item())
    # sinks alone requiring grad is enough to record the graph
    zs = z.clone().requires_grad_()
    out = qkv.attention(q, k, v, sinks=zs, **kw)
    assert out.requires_grad
    out.backward(do)
    assert (zs.grad.double() - ref[3].grad).abs().max() <= 1e-6 * max(1.0, ref[3].grad.abs().max().item())
    # sinks that do not require grad get none, the rest theirs
    ins2 = [x.clone().requires_grad_() for x in (q, k, v)]
    qkv.attention(*ins2, sinks=z, **kw).backward(do)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ins2, ins[:3]))


@pytest.mark.filterwarnings("ignore:Input #3 requires gradient and is not a double")
def test_gradcheck_of_the_sinks_in_float64():
    # q, k, v in float64; the sinks are float32 in the library, so they sit on a grid of 2^-8 and
    # gradcheck's step is 2^-14: z +- eps is exact in float32 (central differences of order eps^2)
    q, k, v = (t64(1, 2, 4, 3, seed=s).requires_grad_() for s in (1, 2, 3))
    z = torch.tensor([0.25, -0.5], dtype=torch.float32, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25])
    eps = 2.0 ** -14
    assert torch.autograd.gradcheck(
        lambda q, k, v, z: qkv.attention(q, k, v, sinks=z, causal=True, alibi_slopes=slopes), (q, k, v, z),
        eps=eps, atol=1e-5, rtol=1e-4)
    assert torch.autograd.gradcheck(
        lambda q, k, v, z: torch.ops.qkv.attention(q, k, v, None, None, z, None, window_left=1, keep_first=1)[0],
        (q, k, v, z), eps=eps, atol=1e-5, rtol=1e-4)


def test_sinks_of_a_model_dtype_get_their_gradient_in_it():
    q, k, v = (torch.randn(1, 2, 3, 8, requires_grad=True) for _ in range(3))
    z = torch.tensor([0.5, -0.5], dtype=torch.bfloat16, requires_grad=True)
    qkv.attention(q, k, v, sinks=z).sum().backward()
    assert z.grad is not None and z.grad.dtype == torch.bfloat16


def test_sdpa_and_flash_attn_func_take_the_options():
    B, Hq, Sq, Sk, D = 2, 4, 5, 8, 8
    q, k, v = t64(B, Hq, Sq, D, seed=1), t64(B, Hq, Sk, D, seed=2), t64(B, Hq, Sk, D, seed=3)
    z = torch.tensor([0.3, -1.0, 1.5, 0.0])
    slopes = torch.from_numpy(qkv.alibi_slopes(Hq))
    out = qkv.torch.scaled_dot_product_attention(q, k, v, is_causal=True, sinks=z, alibi_slopes=slopes)
    want = eager(q, k, v, sinks=z, alibi=slopes.numpy(), causal=True, top_left=True)
    assert (out - want).abs().max() < 1e-12
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out, lse, _ = qkv.flash_attn_func(t(q), t(k), t(v), causal=True, window_size=(2, 0), alibi_slopes=slopes,
                                      sinks=z, keep_first=2, return_attn_probs=True)
    want, want_lse, _ = reference(q.numpy(), k.numpy(), v.numpy(), sinks=z.numpy(), alibi=slopes.numpy(),
                                  causal=True, window=(2, 0), keep_first=2)
    assert np.abs(t(out).numpy() - want).max() < 1e-12 and np.abs(lse.numpy() - want_lse).max() < 1e-12
    with pytest.raises(TypeError, match="keep_first"):
        qkv.torch.scaled_dot_product_attention(q, k, v, keep_first=1)


def test_custom_operator_schema_and_opcheck():
    schema = str(torch.ops.qkv.attention.default._schema)
    assert "Tensor? kv_lens=None, Tensor? sinks=None, Tensor? alibi_slopes=None, *" in schema
    assert schema.split("*, ")[1].split(") ->")[0].endswith("int keep_first=0")
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 6)
    z, slopes = torch.tensor([0.5, -0.5]), torch.tensor([[0.5, 0.25]])
    torch.library.opcheck(torch.ops.qkv.attention.default, (q, k, v, None, None, z, slopes),
                          {"causal": True, "window_left": 1, "keep_first": 1})
    out, lse = torch.ops.qkv.attention(q, k, v, None, None, z, slopes, causal=True)
    grads = torch.ops.qkv.attention_backward(torch.randn_like(out), q, k, v, out, lse, None, None, z, slopes,
                                             causal=True)
    assert len(grads) == 4 and grads[3].shape == (2,) and grads[3].dtype == torch.float32
    torch.library.opcheck(torch.ops.qkv.attention_backward.default, (torch.randn_like(out), q, k, v, out, lse, None,
                                                                     None, z, slopes), {"causal": True})
    # without sinks the fourth output is empty
    out, lse = torch.ops.qkv.attention(q, k, v)
    assert torch.ops.qkv.attention_backward(torch.randn_like(out), q, k, v, out, lse)[3].numel() == 0


def test_compiled_fullgraph_with_sinks_alibi_and_keep_first():
    q, k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(3))
    z = torch.tensor([0.5, -0.5], requires_grad=True)
    slopes = torch.tensor([0.5, 0.25])

    def f(q, k, v, z):
        return qkv.attention(q, k, v, sinks=z, alibi_slopes=slopes, causal=True, window=(2, 0), keep_first=1).sum()

    torch._dynamo.reset()
    eager_grads = torch.autograd.grad(f(q, k, v, z), (q, k, v, z))
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, v, z), (q, k, v, z))
    for a, b in zip(eager_grads, compiled):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- the layer and the cache


def test_layer_with_sinks_and_alibi_is_the_projections_around_qkv_attention():
    rng = np.random.default_rng(3)
    d, H = 16, 4
    w = {n: rng.standard_normal(s).astype(np.float32) * 0.3 for n, s in
         (("in_proj_weight", (3 * d, d)), ("in_proj_bias", (3 * d,)), ("out_proj.weight", (d, d)),
          ("out_proj.bias", (d,)), ("sinks", (H,)))}
    layer = qkv.MultiHeadAttention(d, H, sinks=True, alibi=True)
    assert layer.config["sinks"] and layer.config["alibi"]
    layer.load_state_dict(w)
    assert np.array_equal(layer.weights()["sinks"], w["sinks"])
    x = rng.standard_normal((2, 7, d)).astype(np.float32)
    y = layer(x, causal=True)
    proj = x @ w["in_proj_weight"].T + w["in_proj_bias"]
    q, k, v = (proj[..., i * d:(i + 1) * d].reshape(2, 7, H, d // H).transpose(0, 2, 1, 3) for i in range(3))
    o, _, _ = reference(q, k, v, sinks=w["sinks"], alibi=qkv.alibi_slopes(H), causal=True)
    want = o.transpose(0, 2, 1, 3).reshape(2, 7, d) @ w["out_proj.weight"].T + w["out_proj.bias"]
    assert np.abs(y - want).max() < 1e-5
    # decoding over a cache gives the same rows
    cache = qkv.KVCache(2, H, 8, d // H)
    steps = [layer(x[:, :4], cache=cache, causal=True)] + [layer(x[:, t:t + 1], cache=cache, causal=True)
                                                          for t in range(4, 7)]
    assert np.abs(np.concatenate(steps, 1) - y).max() < 1e-5
    with pytest.raises(ValueError, match="sinks"):
        qkv.MultiHeadAttention(d, H).load_state_dict(w)
    with pytest.raises(ValueError, match="sinks"):
        qkv.MultiHeadAttention(d, H, sinks=True).load_state_dict({n: x for n, x in w.items() if n != "sinks"})


def test_kv_cache_attend_takes_the_options():
    B, Hq, Hkv, D = 1, 4, 2, 8
    cache = qkv.KVCache(B, Hkv, 16, D)
    k, v = rand(B, Hkv, 9, D, seed=1), rand(B, Hkv, 9, D, seed=2)
    cache.append(k, v)
    q = rand(B, Hq, 2, D, seed=3)
    z = np.array([0.1, 0.2, -0.3, 1.0], dtype=np.float32)
    opts = dict(sinks=z, alibi_slopes=qkv.alibi_slopes(Hq), causal=True, window=(3, 0), keep_first=2)
    assert np.array_equal(cache.attend(q, **opts), qkv.attention(q, k, v, **opts))


def test_explain_shows_the_score_options():
    (q, k, v), opts, ref = case_arrays(CASES["all_three_kv_lens"], np.float64)
    steps = qkv.explain(q, k, v, **opts)
    out, lse, p_sink = reference(q, k, v, **ref)
    assert np.abs(steps["output"] - out).max() < 1e-12 and np.abs(steps["softmax_lse"] - lse).max() < 1e-12
    assert np.abs(steps["sink_weights"] - p_sink).max() < 1e-12
    assert np.abs(steps["weights"].sum(-1) + steps["sink_weights"] - 1).max() < 1e-12
    assert np.array_equal(steps["sinks"], opts["sinks"].astype(np.float64)) and steps["keep_first"] == 2
    assert np.array_equal(steps["alibi_slopes"], np.broadcast_to(opts["alibi_slopes"], (2, 4)))
    plain = qkv.explain(q, k, v)
    assert plain["sinks"] is None and plain["sink_weights"] is None and plain["alibi_slopes"] is None


def test_fast_kernels_take_the_options_and_explain_says_which():
    # flash (forward and backward) and decode take all three, equal to the float64 reference
    q = rand(1, 2, 3, 8, seed=0)
    z = np.array([0.5, -1.0], np.float32)
    for kw, name in ((dict(sinks=z), "sinks"), (dict(alibi_slopes=np.abs(z)), "alibi_slopes"),
                     (dict(keep_first=1, window=(1, 0)), "keep_first")):
        assert "reference: usable, lower priority" in qkv.explain_dispatch(q, q, q, **kw)
        ref = qkv.attention(q, q, q, kernel="reference", **kw)
        np.testing.assert_allclose(qkv.attention(q, q, q, kernel="flash", **kw), ref, rtol=0, atol=2e-6)
        np.testing.assert_allclose(qkv.attention(q, q, q, kernel="decode", **kw), ref, rtol=0, atol=2e-6)
        assert "decode: chosen" in qkv.explain_dispatch(q, q, q, **kw), name
    assert "flash: chosen" in qkv.explain_dispatch(q, q, q, sinks=z, backward=True)
    out, lse = qkv.attention(q, q, q, sinks=z, return_lse=True)
    fast = qkv.attention_backward(q, q, q, out, lse, out, sinks=z, kernel="flash")
    ref = qkv.attention_backward(q, q, q, out, lse, out, sinks=z, kernel="reference")
    for a, b in zip(fast, ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="sinks: expected finite"):
        qkv.attention(q, q, q, sinks=np.array([np.nan, 0], np.float32))
