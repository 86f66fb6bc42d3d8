"""The attention options across the boundary: one checked object per call (qkv/_options.py), errors
that name a misspelt or misplaced option, the custom operators' schema, and the autograd paths
(the eager one and the operators') giving the same bits."""
import inspect
import math

import numpy as np
import pytest
import torch

import qkv
import qkv.torch as qt
from qkv import _options, _qkv


def test_fields_match_the_extension():
    # the table's names and defaults are the extension's Options, and every value goes where it is named
    assert {n: getattr(_qkv.Options(), n) for n in _options.NAMES} == {n: d for n, _, d in _options.FIELDS}
    assert tuple(n for n, _ in _options.ARRAY_OPTIONS) == _qkv.ARRAY_OPTIONS
    key = _options.values(scale=0.25, causal=True, align="top_left", window=(3, 1), softcap=1.5, layout="bshd",
                          kernel="reference", num_threads=2, keep_first=4)
    o = _options.options(key)
    assert {n: getattr(o, n) for n in _options.NAMES} == {
        "scale": 0.25, "softcap": 1.5, "causal": True, "align": "top-left", "window_left": 3, "window_right": 1,
        "layout": "bshd", "kernel_name": "reference", "num_threads": 2, "keep_first": 4}
    assert o.bshd and _options.options(key) is o  # equal options share one object
    assert _options.options(_options.values()).scale is None  # the library resolves 1/sqrt(D)
    with pytest.raises(TypeError, match="softcap"):
        _qkv.Options(softcap="x")
    with pytest.raises(ValueError, match="align: expected 'bottom-right' or 'top-left', got 'middle'"):
        _qkv.Options(align="middle")


def test_option_values_are_checked_by_type_and_value():
    values = _options.values
    assert values(causal=1) == values(causal=True) and values(causal=np.bool_(False)) == values()
    assert values(window=np.array([2, 0])) == values(window=(2, 0)) and values(num_threads=np.int64(3))[_options.NAMES.index("num_threads")] == 3
    values(window=(2, 0))  # an entry for the integers does not let floats or bools through
    for bad in ((2.0, 0), (True, 0), (1, 2, 3), "ab", 5):
        with pytest.raises(ValueError, match="window: expected a pair of integers"):
            values(window=bad)
    for kw, exc, match in (({"scale": "x"}, TypeError, "scale: expected a real number"),
                           ({"softcap": None}, TypeError, "softcap: expected a real number"),
                           ({"causal": 1.0}, TypeError, "causal: expected a bool"),
                           ({"causal": 2}, TypeError, "causal: expected a bool"),
                           ({"num_threads": 1.5}, TypeError, "num_threads: expected an integer or None"),
                           ({"num_threads": True}, TypeError, "num_threads: expected an integer or None"),
                           ({"keep_first": 1.0}, TypeError, "keep_first: expected an integer >= 0"),
                           ({"keep_first": -2}, ValueError, "keep_first: expected an integer >= 0"),
                           ({"align": 1}, TypeError, "align: expected a str"),
                           ({"layout": ["bhsd"]}, TypeError, "layout: expected a str"),
                           ({"kernel": "fast"}, ValueError, "kernel: expected 'auto', 'reference', 'flash' or 'decode'"),
                           ({"layout": "sbhd"}, ValueError, "layout: expected 'bhsd' or 'bshd', got 'sbhd'")):
        with pytest.raises(exc, match=match):
            values(**kw)
    # the caller's names in the messages
    with pytest.raises(TypeError, match="is_causal: expected a bool"):
        values(causal="yes", names={"causal": "is_causal"})


def test_scale_default_is_resolved_in_one_place():
    # scale=None reaches the library, which takes 1/sqrt(D): the same bits as passing it
    q = torch.randn(1, 2, 5, 12)
    assert torch.equal(qkv.attention(q, q, q), qkv.attention(q, q, q, scale=1.0 / math.sqrt(12)))
    assert qkv.explain(q, q, q)["scale"] == 1.0 / math.sqrt(12)


def test_misspelt_options_are_named():
    q = torch.randn(1, 2, 4, 8)
    out, lse = qkv.attention(q, q, q, return_lse=True)
    layer, cache = qkv.MultiHeadAttention(16, 4), qkv.KVCache(1, 2, 8, 8)
    calls = [
        (lambda: qkv.attention(q, q, q, casual=True), "attention", "casual", "causal"),
        (lambda: qkv.attention(q, q, q, windows=(1, 1)), "attention", "windows", "window"),
        (lambda: qkv.attention_backward(q, q, q, out, lse, out, sofcap=1.0), "attention_backward", "sofcap",
         "softcap"),
        (lambda: qkv.explain_dispatch(q, q, q, kernal="flash"), "explain_dispatch", "kernal", "kernel"),
        (lambda: qkv.explain(q, q, q, scal=0.5), "explain", "scal", "scale"),
        (lambda: cache.attend(q, num_thread=1), "KVCache.attend", "num_thread", "num_threads"),
        (lambda: layer(torch.randn(1, 3, 16), casual=True), "MultiHeadAttention.__call__", "casual", "causal"),
        (lambda: qt.scaled_dot_product_attention(q, q, q, causal=True), "scaled_dot_product_attention", "causal",
         "is_causal"),
        (lambda: qkv.flash_attn_func(q, q, q, window=(1, 1)), "flash_attn_func", "window", "window_size"),
    ]
    for call, fn, given, meant in calls:
        with pytest.raises(TypeError, match=f"{fn}\\(\\) got an unexpected keyword argument '{given}'; "
                                            f"did you mean '{meant}'\\?"):
            call()
    with pytest.raises(TypeError, match="unexpected keyword argument 'zzz'; it takes q, k, v, scale, causal"):
        qkv.attention(q, q, q, zzz=1)


def test_options_passed_by_position_are_named():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match=r"attention\(\) takes q, k, v by position and its options by keyword only; "
                                        r"argument 4 \(a bool True\) was passed by position: name it \(scale, causal"):
        qkv.attention(q, q, q, True)
    with pytest.raises(TypeError, match=r"argument 4 \(a Tensor of shape \[4, 4\]\)"):
        qkv.explain_dispatch(q, q, q, torch.ones(4, 4))
    with pytest.raises(TypeError, match=r"KVCache.attend\(\) takes q by position .* argument 2 \(a bool True\)"):
        qkv.KVCache(1, 2, 8, 8).attend(q, True)
    # the signatures read without the catch-alls
    sig = inspect.signature(qkv.attention)
    assert list(sig.parameters)[:4] == ["q", "k", "v", "scale"] and "unknown" not in sig.parameters
    assert sig.parameters["causal"].kind is inspect.Parameter.KEYWORD_ONLY


def test_operator_schema_keeps_tensors_first_and_options_by_keyword():
    # adding an option appends a keyword (or an optional tensor after the last one): existing
    # positions and defaults never move
    for op, lead in ((torch.ops.qkv.attention.default, ["q", "k", "v"]),
                     (torch.ops.qkv.attention_backward.default, ["grad_out", "q", "k", "v", "out", "softmax_lse"])):
        args = op._schema.arguments
        positional = [a.name for a in args if not a.kwarg_only]
        assert positional == lead + [n for n, _ in _options.ARRAY_OPTIONS]
        keywords = [a for a in args if a.kwarg_only]
        assert [a.name for a in keywords] == list(_options.NAMES)
        assert all(a.has_default_value() for a in args[len(lead):])
    assert len(torch.ops.qkv.attention_backward.default._schema.returns) == \
        3 + sum(grad for _, grad in _options.ARRAY_OPTIONS)


@pytest.mark.parametrize("opts", [{}, {"causal": True, "align": "top-left"}, {"window": (2, 1), "softcap": 1.5},
                                  {"scale": 0.3, "layout": "bshd"}, {"kernel": "decode"}, {"mask": "bool"}])
def test_eager_autograd_and_operator_give_the_same_bits(opts):
    opts = dict(opts)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    if opts.get("kernel") == "decode":
        q = q[:, :, :1]
    if opts.pop("mask", None):
        opts["mask"] = torch.rand(1, 1, q.shape[2], 5, generator=g) < 0.7
    do = torch.randn(q.shape[:3] + (8,), generator=g)
    a = [x.clone().requires_grad_() for x in (q, k, v)]
    out_a = qkv.attention(*a, **opts)  # eager autograd
    out_a.backward(do)
    b = [x.clone().requires_grad_() for x in (q, k, v)]
    window = opts.pop("window", (-1, -1))
    mask = opts.pop("mask", None)
    kernel = opts.pop("kernel", "auto")
    out_b, _ = torch.ops.qkv.attention(*b, mask, None, window_left=window[0], window_right=window[1],
                                       kernel_name=kernel, **opts)  # the operator's autograd formula
    out_b.backward(do)
    assert torch.equal(out_a, out_b)
    for x, y in zip(a, b):
        assert torch.equal(x.grad, y.grad)


def test_gradcheck_through_the_operator():
    q, k, v = (torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: torch.ops.qkv.attention(q, k, v, causal=True, softcap=2.0)[0],
                                    (q, k, v))


def test_compiled_options_fullgraph():
    q, k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(3))
    mask = torch.rand(6, 6) < 0.8
    mask[:, 0] = True

    def f(q, k, v):
        return qkv.attention(q, k, v, causal=True, window=(3, 0), softcap=2.0, scale=0.4, mask=mask,
                             align="top-left").sum()

    torch._dynamo.reset()
    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
