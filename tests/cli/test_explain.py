"""NumPy cross-checks of `qkv explain`: the written arrays, the printed numbers of a row, the
output against `qkv attend`, the heatmap and plot files, --scaling figures, one layer of the
stories260K model (--model/--prompt), and bad input.

Usage: /usr/bin/python3 tests/cli/test_explain.py <path to qkv>
"""
import os
import re
import struct
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zlib

import numpy as np

QKV = sys.argv[1]
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL:", msg)


def run(*args, expect=0, env=None):
    p = subprocess.run([QKV, *map(str, args)], capture_output=True, text=True, env=env)
    if p.returncode != expect:
        raise AssertionError(f"qkv {' '.join(map(str, args))}: exit {p.returncode}, expected {expect}\n{p.stderr}")
    return p


def reference(q, k, v, scale=None, causal=False, window=None, softcap=0.0, mask=None, align="bottom-right"):
    """float64 attention in NumPy, BHSD; returns scores, scaled, weights, output (excluded: -inf/0)."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    k = np.repeat(k, g, axis=1)
    v = np.repeat(v, g, axis=1)
    scale = 1 / np.sqrt(D) if scale is None else scale
    raw = q @ k.transpose(0, 1, 3, 2)
    s = scale * raw
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    ok = np.ones((B, Hq, Sq, Sk), bool)
    i = np.arange(Sq)[:, None]
    j = np.arange(Sk)[None, :]
    diag = i + Sk - Sq if align == "bottom-right" else i
    left, right = window if window else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    if mask is not None:
        if mask.dtype == bool:
            ok &= np.broadcast_to(mask, ok.shape)
        else:
            s = s + mask
            ok &= np.broadcast_to(mask, ok.shape) != -np.inf
    s = np.where(ok, s, -np.inf)
    raw = np.where(ok, raw, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.where(ok, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    tot = e.sum(-1, keepdims=True)
    w = np.where(tot > 0, e / np.where(tot > 0, tot, 1), 0)
    return raw, s, w, w @ v


def load(d, name):
    return np.load(os.path.join(d, name))


def close(a, b, tol, msg):
    a, b = np.asarray(a), np.asarray(b)
    same_inf = np.array_equal(np.isinf(a), np.isinf(b)) and np.array_equal(a[np.isinf(a)], b[np.isinf(b)])
    fa, fb = a[np.isfinite(a)], b[np.isfinite(b)]
    err = np.max(np.abs(fa - fb)) if fa.size and fa.shape == fb.shape else 0.0
    check(same_inf and fa.shape == fb.shape and err <= tol, f"{msg}: max abs diff {err}, tol {tol}, inf pattern same: {same_inf}")


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    check(head[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG")
    return struct.unpack(">II", head[16:24])


def png_decode(path):
    """Width, height and the unfiltered-size check of an 8-bit RGB PNG: the IDAT stream inflates
    to height rows of one filter byte (0..4) plus 3*width bytes."""
    with open(path, "rb") as fh:
        data = fh.read()
    check(data[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG")
    pos, idat, w, h = 8, b"", 0, 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        check(zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0], f"{path}: CRC of {kind}")
        if kind == b"IHDR":
            w, h, depth, colour = struct.unpack(">IIBB", body[:10])
            check(depth == 8 and colour == 2, f"{path}: 8-bit RGB")
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    check(len(raw) == h * (1 + 3 * w), f"{path}: {len(raw)} bytes inflated, expected {h * (1 + 3 * w)}")
    check(all(raw[r * (1 + 3 * w)] <= 4 for r in range(h)), f"{path}: row filter bytes")
    return w, h


MODEL_PROMPT = "Once upon a time, there was a little girl named Lily. She"


def test_model(tmp):
    """`--model --prompt --layer`: layer 2 of stories260K on a prompt; the arrays against NumPy on
    the written q, k, v and against `qkv attend`, the in-run checks against the model's own
    attention weights, labels, the printed row, the heatmap grid of all heads, and bad input."""
    f = lambda name: os.path.join(tmp, name)
    p = run("explain", "--prompt", MODEL_PROMPT, "--layer", "2", "--out-dir", f("m"), "--heatmap", f("m.png"),
            "--heatmap", f("m.svg"))
    lines = p.stdout.splitlines()
    check(lines[0].startswith("qkv explain: stories260K.bin, layer 2 of 5: Hq 8, Hkv 4,"), f"header: {lines[0]}")
    tok_line = [l for l in lines if l.startswith("tokens: ")][0]
    labels = [t.split(" ", 1)[1] for t in tok_line[len("tokens: "):].split(", ")]
    S = len(labels)
    check(labels[0] == "<s>" and "".join(labels[1:]).replace("\u2581", " ") == " " + MODEL_PROMPT,
          f"labels spell the prompt: {labels}")
    check("\u2581Lily" in labels and "\u2581She" in labels, "word-start pieces marked with U+2581")
    for what in ("weights vs the model's attention weights", "z vs qkv::attention"):
        l = [x for x in lines if x.startswith("check: " + what)]
        check(len(l) == 1 and l[0].endswith(" OK"), f"in-run check {what}: {l}")
    q, k, v = (load(f("m"), n + ".npy") for n in ("q", "k", "v"))
    check(q.dtype == np.float32 and q.shape == (1, 8, S, 8) and k.shape == (1, 4, S, 8) and v.shape == (1, 4, S, 8),
          f"q, k, v shapes {q.shape} {k.shape} {v.shape}")
    raw, s, w, o = reference(q, k, v, causal=True)
    for name, ref in (("scores", raw), ("scaled", s), ("weights", w), ("output", o)):
        got = load(f("m"), name + ".npy")
        check(got.shape == (1, 8, S, S if name != "output" else 8), f"model {name}.npy shape {got.shape}")
        close(got, ref, 1e-12, f"model {name}.npy vs NumPy on q, k, v")
    wts = load(f("m"), "weights.npy")
    close(wts.sum(-1), np.ones((1, 8, S)), 1e-14, "model weights sum to 1")
    check(np.all(wts[0][:, np.triu_indices(S, 1)[0], np.triu_indices(S, 1)[1]] == 0), "causal: no weight on later tokens")
    run("attend", "--q", f("m/q.npy"), "--k", f("m/k.npy"), "--v", f("m/v.npy"), "--causal", "--out", f("m_att.npy"),
        "--probs", f("m_probs.npy"))
    close(load(f("m"), "output.npy"), np.load(f("m_att.npy")), 2e-6, "model output.npy vs qkv attend")
    close(wts, np.load(f("m_probs.npy")), 2e-6, "model weights.npy vs qkv attend --probs")
    # 8 heads x S rows x S keys printed: one row header per (head, query).
    check(sum(1 for l in lines if re.match(r"^batch 0, head \d+ \(kv head \d+\), query \d+", l)) == 8 * S,
          "every head and row printed")

    # Heatmaps: all 8 heads of the layer, labels, tooltips = weights.
    wpx, hpx = png_decode(f("m.png"))
    root = ET.parse(f("m.svg")).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    check(int(root.get("width")) == wpx and int(root.get("height")) == hpx, "model svg and png share the layout")
    cells = [r for r in root.iter(ns + "rect") if r.get("class") == "cell"]
    check(len(cells) == 8 * S * S, f"model svg holds 8 x {S} x {S} cells, got {len(cells)}")
    texts = [t.text for t in root.iter(ns + "text")]
    check(all(f"head {h} (kv {h // 2})" in texts for h in range(8)), "panel titles name the head and kv head")
    check("\u2581Lily" in texts, "svg labels are the pieces")
    tips = np.array([float(r.find(ns + "title").text.rsplit(": ", 1)[1]) for r in cells])
    close(tips, wts[0].reshape(-1), 1e-5, "model svg tooltips hold the weights")

    # One head, one row, explicit model and tokenizer paths (bare --model = the default model).
    i = labels.index("\u2581She")
    model_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models", "stories260K")
    for model_args in (["--model"], ["--model", os.path.join(model_dir, "stories260K.bin"), "--tokenizer",
                                     os.path.join(model_dir, "tok512.bin")]):
        p = run("explain", *model_args, "--prompt", MODEL_PROMPT, "--layer", "2", "--head", "3", "--query", str(i), "--top", "1")
        rows = p.stdout.splitlines()
        check(sum(1 for l in rows if l.startswith("batch 0, head")) == 1, f"{model_args}: one row printed")
        key_lines = [m for m in (re.match(r"^\s+(\d+) (\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$", l) for l in rows) if m]
        check(len(key_lines) == i + 1, f"{model_args}: {i + 1} admitted keys printed, got {len(key_lines)}")
        for m in key_lines:
            j = int(m.group(1))
            check(m.group(2) == labels[j], f"label of key {j}")
            check(abs(float(m.group(6)) - wts[0, 3, i, j]) <= 1e-5 * max(1, wts[0, 3, i, j]), f"printed weight of key {j}")
        top = int(np.argmax(wts[0, 3, i]))
        check(any(l.strip().startswith(f"most weight: {top} ") for l in rows), f"{model_args}: top key {top}")

    # Bad input: one line, exit 2, nothing written.
    bad = ((("--prompt", MODEL_PROMPT, "--layer", "5"), "--layer"),
           (("--prompt", MODEL_PROMPT, "--layer", "-1"), "--layer"),
           (("--prompt", MODEL_PROMPT), "--layer"),
           (("--prompt", MODEL_PROMPT, "--layer", "0", "--head", "8"), "--head"),
           (("--prompt", MODEL_PROMPT, "--layer", "0", "--query", str(S)), "--query"),
           (("--prompt", "", "--layer", "0"), "--prompt"),
           (("--model", "--layer", "0"), "--prompt"),
           (("--model", f("missing.bin"), "--prompt", MODEL_PROMPT, "--layer", "0"), "--model"),
           (("--prompt", MODEL_PROMPT, "--layer", "0", "--tokenizer", f("missing.bin")), "--tokenizer"),
           (("--prompt", MODEL_PROMPT, "--layer", "0", "--scale", "1"), "--scale"),
           (("--prompt", MODEL_PROMPT, "--layer", "0", "--heatmap", f("m.bmp")), "heatmap"))
    for args, what in bad:
        p = run("explain", *args, "--out-dir", f("mbad"), expect=2)
        err = p.stderr.strip().splitlines()
        check(len(err) == 1 and err[0].startswith("qkv: error:") and what in err[0], f"error for {args}: {p.stderr!r}")
        check(not os.path.exists(f("mbad")) or not os.listdir(f("mbad")), f"no output after the {args} error")
    check(not os.path.exists(f("m.bmp")), "no heatmap after a bad extension")
    # The default model looked up under $QKV_MODELS_DIR when set.
    p = run("explain", "--prompt", MODEL_PROMPT, "--layer", "0", expect=2, env={**os.environ, "QKV_MODELS_DIR": f("nowhere")})
    check(p.stderr.startswith("qkv: error: --model:") and "nowhere" in p.stderr and len(p.stderr.strip().splitlines()) == 1,
          f"missing default model: {p.stderr!r}")


def main():
    rng = np.random.default_rng(0)
    tmp = tempfile.mkdtemp(prefix="qkv_explain_")
    f = lambda name: os.path.join(tmp, name)

    # 1. GQA, causal, Sq < Sk: arrays against NumPy and output against `qkv attend`.
    q = rng.standard_normal((2, 4, 5, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 7, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 7, 3)).astype(np.float32)
    for n, a in (("q", q), ("k", k), ("v", v)):
        np.save(f(n + ".npy"), a)
    run("explain", "--q", f("q.npy"), "--k", f("k.npy"), "--v", f("v.npy"), "--causal", "--out-dir", f("out1"))
    raw, s, w, o = reference(q, k, v, causal=True)
    for name, ref in (("scores", raw), ("scaled", s), ("weights", w), ("output", o)):
        got = load(f("out1"), name + ".npy")
        check(got.dtype == np.float64, f"{name}.npy dtype {got.dtype}")
        check(got.shape == ref.shape, f"{name}.npy shape {got.shape} != {ref.shape}")
        close(got, ref, 1e-12, f"causal GQA {name}.npy vs NumPy")
    wts = load(f("out1"), "weights.npy")
    close(wts.sum(-1), np.ones(wts.shape[:-1]), 1e-14, "weights sum to 1")
    run("attend", "--q", f("q.npy"), "--k", f("k.npy"), "--v", f("v.npy"), "--causal", "--out", f("attend1.npy"),
        "--probs", f("probs1.npy"))
    close(load(f("out1"), "output.npy"), np.load(f("attend1.npy")), 2e-6, "output.npy vs qkv attend")
    close(wts, np.load(f("probs1.npy")), 2e-6, "weights.npy vs qkv attend --probs")

    # 2. BSHD layout, window, softcap, additive mask, explicit scale.
    qb = rng.standard_normal((1, 6, 2, 4)).astype(np.float32)
    kb = rng.standard_normal((1, 6, 2, 4)).astype(np.float32)
    vb = rng.standard_normal((1, 6, 2, 4)).astype(np.float32)
    mask = (rng.standard_normal((6, 6)) * 0.5).astype(np.float32)
    mask[0, 1] = -np.inf
    for n, a in (("qb", qb), ("kb", kb), ("vb", vb), ("mask", mask)):
        np.save(f(n + ".npy"), a)
    opts = ["--layout", "bshd", "--window", "2,1", "--softcap", "1.5", "--mask", f("mask.npy"), "--scale", "0.7"]
    run("explain", "--q", f("qb.npy"), "--k", f("kb.npy"), "--v", f("vb.npy"), *opts, "--out-dir", f("out2"))
    T = lambda a: a.transpose(0, 2, 1, 3)
    raw, s, w, o = reference(T(qb), T(kb), T(vb), scale=0.7, window=(2, 1), softcap=1.5, mask=mask.astype(np.float64))
    for name, ref in (("scores", raw), ("scaled", s), ("weights", w)):
        close(load(f("out2"), name + ".npy"), ref, 1e-6, f"bshd/window/softcap/mask {name}.npy")
    check(load(f("out2"), "output.npy").shape == (1, 6, 2, 4), "output.npy keeps the bshd layout")
    close(load(f("out2"), "output.npy"), T(o), 1e-6, "bshd output.npy vs NumPy")
    run("attend", "--q", f("qb.npy"), "--k", f("kb.npy"), "--v", f("vb.npy"), *opts, "--out", f("attend2.npy"))
    close(load(f("out2"), "output.npy"), np.load(f("attend2.npy")), 2e-6, "bshd output.npy vs qkv attend")

    # 3. The printed row: every number against NumPy, labels shown.
    labels = ["the", "cat", "sat", "on", "the", "mat", "today"]
    p = run("explain", "--q", f("q.npy"), "--k", f("k.npy"), "--v", f("v.npy"), "--causal", "--query", "3",
            "--head", "1", "--batch", "1", "--labels", ",".join(labels), "--top", "2")
    raw, s, w, o = reference(q, k, v, causal=True)
    lines = p.stdout.splitlines()
    check(any('batch 1, head 1 (kv head 0), query 3 "mat"' in l for l in lines), "row header names the query token")
    seen = 0
    for l in lines:
        m = re.match(r"^\s+(\d+) (\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$", l)
        if m:
            j = int(m.group(1))
            check(m.group(2) == labels[j], f"label of key {j}")
            for got, ref, what in ((m.group(3), raw[1, 1, 3, j], "q.k"), (m.group(4), 1 / np.sqrt(8) * raw[1, 1, 3, j], "x scale"),
                                   (m.group(5), s[1, 1, 3, j], "logit"), (m.group(6), w[1, 1, 3, j], "weight")):
                check(abs(float(got) - ref) <= 1e-5 * max(1, abs(ref)), f"printed {what} of key {j}: {got} vs {ref}")
            seen += 1
        elif re.match(r"^\s+(\d+) (\S+)\s+-inf\s+\(excluded by causal/window", l):
            j = int(l.split()[0])
            check(w[1, 1, 3, j] == 0, f"key {j} printed as excluded")
            seen += 1
    check(seen == 7, f"7 key lines printed, saw {seen}")
    zl = [l for l in lines if "z = sum_j weight_j v_j = [" in l]
    check(len(zl) == 1, "one z line")
    z = [float(x) for x in zl[0].split("[")[1].rstrip("]").split(",")]
    close(np.array(z), o[1, 1, 3], 1e-5, "printed z")
    order = np.argsort(-w[1, 1, 3], kind="stable")[:2]
    mw = [l for l in lines if "most weight:" in l][0]
    want = ", ".join(f'{j} "{labels[j]}" ({w[1, 1, 3, j]:.6g})' for j in order)
    check(mw.strip() == "most weight: " + want, f"top keys line: {mw.strip()!r} vs {want!r}")

    # 4. From token vectors: q = x W^Q etc. (row-vector convention), two heads.
    x = rng.standard_normal((5, 6)).astype(np.float32)
    wq, wk, wv = (rng.standard_normal((6, 4)).astype(np.float32) for _ in range(3))
    for n, a in (("x", x), ("wq", wq), ("wk", wk), ("wv", wv)):
        np.save(f(n + ".npy"), a)
    run("explain", "--x", f("x.npy"), "--wq", f("wq.npy"), "--wk", f("wk.npy"), "--wv", f("wv.npy"), "--heads", "2",
        "--causal", "--out-dir", f("out3"), "--heatmap", f("x.png"), "--heatmap", f("x.svg"), "--heatmap", f("x.html"),
        "--labels", "a,b,c,d,e")
    xd = x.astype(np.float64)
    heads = lambda w_: (xd @ w_.astype(np.float64)).reshape(5, 2, 2).transpose(1, 0, 2)[None]
    close(load(f("out3"), "q.npy"), heads(wq), 1e-12, "q.npy = x W^Q")
    close(load(f("out3"), "v.npy"), heads(wv), 1e-12, "v.npy = x W^V")
    raw, s, w, o = reference(heads(wq), heads(wk), heads(wv), causal=True)
    close(load(f("out3"), "weights.npy"), w, 1e-12, "x-mode weights.npy")
    run("attend", "--q", f("out3/q.npy"), "--k", f("out3/k.npy"), "--v", f("out3/v.npy"), "--causal", "--out", f("attend3.npy"))
    close(load(f("out3"), "output.npy"), np.load(f("attend3.npy")), 2e-6, "x-mode output.npy vs qkv attend")

    # 5. Heatmap files.
    wpx, hpx = png_size(f("x.png"))
    check(wpx >= 2 * 5 * 4 and hpx >= 5 * 4, f"png size {wpx}x{hpx}")
    root = ET.parse(f("x.svg")).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    cells = [r for r in root.iter(ns + "rect") if r.get("class") == "cell"]
    check(len(cells) == 2 * 5 * 5, f"svg holds 50 cells, got {len(cells)}")
    texts = [t.text for t in root.iter(ns + "text")]
    check(all(lab in texts for lab in "abcde"), "svg labels are text")
    check(int(root.get("width")) == wpx and int(root.get("height")) == hpx, "svg and png share the layout")
    html = open(f("x.html"), encoding="utf-8").read()
    check(html.startswith("<!DOCTYPE html>") and "<svg" in html and html.rstrip().endswith("</html>"), "html page")

    # One head of batch 1, labels from a file (UTF-8 kept in the SVG).
    with open(f("labels.txt"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(["\u2581once", "upon", "a", "time", "there", "was", "a"]) + "\n")
    run("explain", "--q", f("q.npy"), "--k", f("k.npy"), "--v", f("v.npy"), "--causal", "--head", "1", "--batch", "1",
        "--labels-file", f("labels.txt"), "--heatmap", f("one.svg"), "--query", "0")
    root = ET.parse(f("one.svg")).getroot()
    cells = [r for r in root.iter(ns + "rect") if r.get("class") == "cell"]
    check(len(cells) == 5 * 7, f"one-head svg holds 35 cells, got {len(cells)}")
    texts = [t.text for t in root.iter(ns + "text")]
    check("\u2581once" in texts and "head 1" in texts, "one-head svg: UTF-8 label and panel title")
    w1 = reference(q, k, v, causal=True)[2][1, 1]
    tips = [r.find(ns + "title").text for r in cells]
    check(all(abs(float(tip.rsplit(": ", 1)[1]) - w1[n // 7, n % 7]) <= 1e-5 * max(1, w1[n // 7, n % 7])
              for n, tip in enumerate(tips)), "svg tooltips hold the weights of batch 1, head 1")

    # Sinks: the heatmap gains a "sink" column whose weight completes each row to 1.
    np.save(f("z.npy"), np.array([0.5, -1.0, 2.0, 0.0], dtype=np.float32))
    p = run("explain", "--q", f("q.npy"), "--k", f("k.npy"), "--v", f("v.npy"), "--causal", "--batch", "1",
            "--sinks", f("z.npy"), "--heatmap", f("sink.svg"), "--query", "0", "--head", "0")
    check("sink" in p.stdout and "sum of weights (sink included) = 1;" in p.stdout, "sink row printed")
    root = ET.parse(f("sink.svg")).getroot()
    cells = [r for r in root.iter(ns + "rect") if r.get("class") == "cell"]
    check(len(cells) == 5 * 8, f"sink svg holds 5 x (7 + 1) cells, got {len(cells)}")
    check("sink" in [t.text for t in root.iter(ns + "text")], "sink column labelled")
    vals = np.array([float(r.find(ns + "title").text.rsplit(": ", 1)[1]) for r in cells]).reshape(5, 8)
    check(np.allclose(vals.sum(1), 1.0, atol=5e-5), f"rows with the sink sum to 1: {vals.sum(1)}")

    # 6. --scaling: the figures at d_k = 64, and the plot.
    p = run("explain", "--scaling", "--samples", "300", "--d-k", "4,64", "--plot", f("s.svg"), "--plot", f("s.png"))
    row = [l for l in p.stdout.splitlines() if re.match(r"^\s+64 \|", l)][0].split("|")
    mean, var, expect, std = (float(t) for t in row[1].split())
    check(abs(mean) < 0.5 and abs(var - 64) < 6 and expect == 64 and abs(std - 8) < 0.4, f"d_k 64 row: {row}")
    mean_s, var_s = (float(t) for t in row[2].split())
    check(abs(var_s - 1) < 0.1, f"scaled variance {var_s}")
    check("At d_k = 64: unscaled scores have standard deviation" in p.stdout, "reading printed")
    ET.parse(f("s.svg"))
    check(png_size(f("s.png")) == (716, 558), "plot png size")

    # 7. Bad input: exit 2, one line, nothing written.
    for args, what in (((*["--q", f("q.npy"), "--k", f("k.npy"), "--v", f("v.npy")], "--labels", "a,b", "--out-dir", f("bad")), "--labels"),
                       ((*["--q", f("q.npy"), "--k", f("k.npy"), "--v", f("v.npy")], "--query", "9", "--out-dir", f("bad")), "--query"),
                       (("--q", f("q.npy"), "--k", f("k.npy"), "--out-dir", f("bad")), "--v"),
                       (("--q", f("q.npy"), "--k", f("v.npy"), "--v", f("v.npy"), "--out-dir", f("bad")), "k:"),
                       (("--q", f("q.npy"), "--k", f("k.npy"), "--v", f("v.npy"), "--heatmap", f("h.bmp")), "heatmap")):
        p = run("explain", *args, expect=2)
        err = p.stderr.strip().splitlines()
        check(len(err) == 1 and err[0].startswith("qkv: error:") and what in err[0], f"error for {what}: {p.stderr!r}")
        check(not os.path.exists(f("bad")) or not os.listdir(f("bad")), f"no output after the {what} error")
    check(not os.path.exists(f("h.bmp")), "no heatmap after a bad extension")

    test_model(tmp)

    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("ok")


main()
