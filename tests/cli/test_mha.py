#!/usr/bin/env python3
"""Cross-checks `qkv mha` against a float64 NumPy implementation of PyTorch's
nn.MultiheadAttention (packed in_proj_weight layout, key_padding_mask / attn_mask with True =
ignore, average_attn_weights), extended with GQA and RoPE as Llama / GPT-NeoX use them.
The safetensors files are written by hand (struct + json), independently of qkv's writer.

usage: test_mha.py <path to the qkv binary>
"""
import atexit
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np

QKV = sys.argv[1]
TMP = tempfile.mkdtemp(prefix="qkv_mha_")
atexit.register(shutil.rmtree, TMP, True)
TOL = 1e-5
failures = []


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else "  " + detail))
    if not cond:
        failures.append(name)


def write_safetensors(path, tensors, metadata=None, dtype="F32"):
    """Writes {name: float array} as a safetensors file (F32, F16 or F64)."""
    np_dtype = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}[dtype]
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, arr in tensors.items():
        b = np.ascontiguousarray(arr, dtype=np_dtype).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def rope(x, pos, style, theta):
    """x [B,H,S,D] float64; RoFormer rotation with angles in float64."""
    D = x.shape[-1]
    j = np.arange(D // 2)
    ang = pos[:, None] * theta ** (-2.0 * j / D)  # [S, D/2]
    c, s = np.cos(ang), np.sin(ang)
    y = x.copy()
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        y[..., 0::2] = a * c - b * s
        y[..., 1::2] = b * c + a * s
    else:
        a, b = x[..., : D // 2], x[..., D // 2 :]
        y[..., : D // 2] = a * c - b * s
        y[..., D // 2 :] = b * c + a * s
    return y


def mha_ref(xq, xkv, Wq, Wk, Wv, Wo, bq, bk, bv, bo, Hq, Hkv, key_padding_mask=None, attn_mask=None,
            causal=False, rope_style=None, theta=10000.0):
    """PyTorch nn.MultiheadAttention forward (batch_first=True) in float64, plus GQA and RoPE.
    Returns (y [B,Sq,E], weights averaged over heads [B,Sq,Sk], weights per head)."""
    xq, xkv = xq.astype(np.float64), xkv.astype(np.float64)
    B, Sq, _ = xq.shape
    Sk = xkv.shape[1]
    q = xq @ Wq.T + (bq if bq is not None else 0)
    k = xkv @ Wk.T + (bk if bk is not None else 0)
    v = xkv @ Wv.T + (bv if bv is not None else 0)
    D = Wq.shape[0] // Hq
    Dv = Wv.shape[0] // Hkv
    q = q.reshape(B, Sq, Hq, D).transpose(0, 2, 1, 3)
    k = k.reshape(B, Sk, Hkv, D).transpose(0, 2, 1, 3)
    v = v.reshape(B, Sk, Hkv, Dv).transpose(0, 2, 1, 3)
    if rope_style:
        q = rope(q, np.arange(Sq, dtype=np.float64), rope_style, theta)
        k = rope(k, np.arange(Sk, dtype=np.float64), rope_style, theta)
    k = np.repeat(k, Hq // Hkv, axis=1)
    v = np.repeat(v, Hq // Hkv, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)  # [B,Hq,Sq,Sk]
    if attn_mask is not None:
        am = attn_mask if attn_mask.ndim == 2 else attn_mask.reshape(B, Hq, Sq, Sk)
        s = s + (np.where(am, -np.inf, 0.0) if am.dtype == bool else am)
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, :]
        s = s + (np.where(kpm, -np.inf, 0.0) if kpm.dtype == bool else kpm)
    if causal:
        i = np.arange(Sq)[:, None] + (Sk - Sq)  # bottom-right diagonal
        s = np.where(np.arange(Sk)[None, :] <= i, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    p = p / p.sum(axis=-1, keepdims=True)
    o = (p @ v).transpose(0, 2, 1, 3).reshape(B, Sq, Hq * Dv)
    y = o @ Wo.T + (bo if bo is not None else 0)
    return y, p.mean(axis=1), p


def run(args, expect_rc=0):
    r = subprocess.run([QKV, "mha"] + args, capture_output=True, text=True)
    if r.returncode != expect_rc:
        print(r.stdout, r.stderr)
    return r


def path(name):
    return os.path.join(TMP, name)


rng = np.random.default_rng(1234)


def randn(*shape, sd=1.0):
    return (rng.standard_normal(shape) * sd).astype(np.float32)


# 1. PyTorch packed layout, biases, key_padding_mask + attn_mask (True = ignore), averaged weights.
B, S, E, H = 2, 7, 32, 4
x = randn(B, S, E)
W_in, b_in = randn(3 * E, E, sd=E ** -0.5), randn(3 * E, sd=0.1)
W_o, b_o = randn(E, E, sd=E ** -0.5), randn(E, sd=0.1)
write_safetensors(path("pt.safetensors"), {"self_attn.in_proj_weight": W_in, "self_attn.in_proj_bias": b_in,
                                           "self_attn.out_proj.weight": W_o, "self_attn.out_proj.bias": b_o})
np.save(path("x.npy"), x)
Wq, Wk, Wv = np.split(W_in.astype(np.float64), 3)
bq, bk, bv = np.split(b_in.astype(np.float64), 3)
kpm = np.zeros((B, S), dtype=bool)
kpm[1, 5:] = True  # batch 1: the last two keys are padding
am = rng.random((S, S)) < 0.2
np.fill_diagonal(am, False)
np.save(path("kpm.npy"), kpm)
np.save(path("am.npy"), am)
y_ref, w_ref, _ = mha_ref(x, x, Wq, Wk, Wv, W_o.astype(np.float64), bq, bk, bv, b_o.astype(np.float64), H, H,
                          key_padding_mask=kpm, attn_mask=am)
r = run(["--x", path("x.npy"), "--weights", path("pt.safetensors"), "--out", path("y.npy"), "--heads", str(H),
         "--prefix", "self_attn.", "--key-padding-mask", path("kpm.npy"), "--attn-mask", path("am.npy"),
         "--probs", path("w.npy"), "--average-probs"])
if r.returncode == 0:
    err = np.abs(np.load(path("y.npy")) - y_ref).max()
    check("packed + masks: y", err <= TOL, f"max err {err}")
    werr = np.abs(np.load(path("w.npy")) - w_ref).max()
    check("packed + masks: averaged weights", werr <= TOL, f"max err {werr}")
    check("padding keys get zero weight", np.all(np.load(path("w.npy"))[1, :, 5:] == 0))
else:
    check("packed + masks runs", False, r.stderr)

# Inverting the polarity would change the answer (the test can tell the two apart).
flipped = kpm.copy()
flipped[1] = ~kpm[1]
y_wrong, _, _ = mha_ref(x, x, Wq, Wk, Wv, W_o.astype(np.float64), bq, bk, bv, b_o.astype(np.float64), H, H,
                        key_padding_mask=flipped, attn_mask=am)
check("mask polarity is observable", np.abs(y_wrong[1] - y_ref[1]).max() > 1e-2)

# 1b. The same weights as a directory of <name>.npy files.
os.makedirs(path("npy_weights"), exist_ok=True)
for name, arr in {"in_proj_weight": W_in, "in_proj_bias": b_in, "out_proj.weight": W_o,
                  "out_proj.bias": b_o}.items():
    np.save(os.path.join(path("npy_weights"), name + ".npy"), arr.astype(np.float64))
y_ref1b, _, _ = mha_ref(x, x, Wq, Wk, Wv, W_o.astype(np.float64), bq, bk, bv, b_o.astype(np.float64), H, H)
r = run(["--x", path("x.npy"), "--weights", path("npy_weights"), "--out", path("y1b.npy"), "--heads", str(H)])
if r.returncode == 0:
    err = np.abs(np.load(path("y1b.npy")) - y_ref1b).max()
    check("weights from a .npy directory", err <= TOL, f"max err {err}")
else:
    check("weights from a .npy directory runs", False, r.stderr)

# 2. Float key_padding_mask (additive) without masks, per-head weights, 2-D input.
fkpm = np.where(kpm, -1e4, 0.0).astype(np.float32)[:1]
np.save(path("fkpm.npy"), fkpm)
np.save(path("x2d.npy"), x[0])
y_ref2, _, p_ref2 = mha_ref(x[:1], x[:1], Wq, Wk, Wv, W_o.astype(np.float64), bq, bk, bv, b_o.astype(np.float64),
                            H, H, key_padding_mask=fkpm.astype(np.float64))
r = run(["--x", path("x2d.npy"), "--weights", path("pt.safetensors"), "--out", path("y2.npy"), "--heads", str(H),
         "--prefix", "self_attn.", "--key-padding-mask", path("fkpm.npy"), "--probs", path("p2.npy")])
if r.returncode == 0:
    y2 = np.load(path("y2.npy"))
    check("2-D input keeps rank", y2.shape == (S, E), str(y2.shape))
    check("float padding mask: y", np.abs(y2 - y_ref2[0]).max() <= TOL, f"{np.abs(y2 - y_ref2[0]).max()}")
    check("per-head weights", np.abs(np.load(path("p2.npy")) - p_ref2).max() <= TOL)
else:
    check("float padding mask runs", False, r.stderr)

# 3. Hugging Face names, GQA (Hq 4, Hkv 2), no biases, RoPE interleaved, causal, heads from metadata.
Hq, Hkv, D = 4, 2, 8
Wq3, Wk3, Wv3 = randn(Hq * D, E, sd=E ** -0.5), randn(Hkv * D, E, sd=E ** -0.5), randn(Hkv * D, E, sd=E ** -0.5)
Wo3 = randn(E, Hq * D, sd=(Hq * D) ** -0.5)
write_safetensors(path("hf.safetensors"), {"q_proj.weight": Wq3, "k_proj.weight": Wk3, "v_proj.weight": Wv3,
                                           "o_proj.weight": Wo3},
                  metadata={"num_heads": str(Hq), "num_kv_heads": str(Hkv)})
for style, cli_style, theta in [("interleaved", "interleaved", 10000.0), ("half", "half", 500000.0)]:
    y_ref3, _, _ = mha_ref(x, x, *(w.astype(np.float64) for w in (Wq3, Wk3, Wv3, Wo3)), None, None, None, None,
                           Hq, Hkv, causal=True, rope_style=style, theta=theta)
    r = run(["--x", path("x.npy"), "--weights", path("hf.safetensors"), "--out", path("y3.npy"), "--causal",
             "--rope", cli_style, "--rope-theta", str(theta)])
    if r.returncode == 0:
        err = np.abs(np.load(path("y3.npy")) - y_ref3).max()
        check(f"GQA + RoPE {style} + causal", err <= TOL, f"max err {err}")
    else:
        check(f"GQA + RoPE {style} runs", False, r.stderr)

# 4. float16 weights (converted at load) and cross-attention.
xkv = randn(B, 11, E)
np.save(path("xkv.npy"), xkv)
write_safetensors(path("f16.safetensors"), {"in_proj_weight": W_in, "in_proj_bias": b_in, "out_proj.weight": W_o,
                                            "out_proj.bias": b_o}, dtype="F16")
h = lambda a: a.astype(np.float16).astype(np.float64)
Wq4, Wk4, Wv4 = np.split(h(W_in), 3)
bq4, bk4, bv4 = np.split(h(b_in), 3)
y_ref4, _, _ = mha_ref(x, xkv, Wq4, Wk4, Wv4, h(W_o), bq4, bk4, bv4, h(b_o), H, H)
r = run(["--x", path("x.npy"), "--x-kv", path("xkv.npy"), "--weights", path("f16.safetensors"), "--out",
         path("y4.npy"), "--heads", str(H)])
if r.returncode == 0:
    err = np.abs(np.load(path("y4.npy")) - y_ref4).max()
    check("float16 weights, cross-attention", err <= TOL, f"max err {err}")
else:
    check("cross-attention runs", False, r.stderr)

# 5. Bad input: exit 2, one line on stderr starting 'qkv: error:', no output file.
def expect_error(name, args, needle):
    out = path("never.npy")
    if os.path.exists(out):
        os.remove(out)
    r = run(args + ["--out", out], expect_rc=2)
    lines = r.stderr.strip().splitlines()
    ok = r.returncode == 2 and len(lines) == 1 and lines[0].startswith("qkv: error:") and needle in lines[0]
    check(name, ok and not os.path.exists(out), f"rc {r.returncode}, stderr {r.stderr!r}")


with open(path("pt.safetensors"), "rb") as f:
    blob = f.read()
with open(path("trunc.safetensors"), "wb") as f:
    f.write(blob[:-10])
with open(path("hostile.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", 1 << 60) + b"{}")
expect_error("truncated weights", ["--x", path("x.npy"), "--weights", path("trunc.safetensors"), "--heads", "4"],
             "beyond the data buffer")
expect_error("absurd header length", ["--x", path("x.npy"), "--weights", path("hostile.safetensors"), "--heads", "4"],
             "100 MB")
expect_error("missing --heads", ["--x", path("x.npy"), "--weights", path("pt.safetensors"), "--prefix", "self_attn."],
             "--heads")
np.save(path("x_bad.npy"), randn(B, S, E + 1))
expect_error("wrong d_model", ["--x", path("x_bad.npy"), "--weights", path("pt.safetensors"), "--heads", "4",
                               "--prefix", "self_attn."], "d_model")
expect_error("heads not dividing", ["--x", path("x.npy"), "--weights", path("pt.safetensors"), "--heads", "5",
                                    "--prefix", "self_attn."], "Hq")
np.save(path("kpm_bad.npy"), np.zeros((B, S + 1), dtype=bool))
expect_error("bad padding mask shape", ["--x", path("x.npy"), "--weights", path("pt.safetensors"), "--heads", "4",
                                        "--prefix", "self_attn.", "--key-padding-mask", path("kpm_bad.npy")],
             "key_padding_mask")

print(f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
