#!/usr/bin/python3
"""Writes the small seed corpora of the fuzz targets into tests/fuzz/corpus/<target>/.

Every seed is a tiny valid (or nearly valid) file, so that the fuzzer starts inside the
interesting part of each format. Run again to regenerate; the files are checked in.
"""
import io
import json
import os
import struct

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def out(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def npy_bytes(a, version=None):
    b = io.BytesIO()
    np.lib.format.write_array(b, a, version=version)
    return b.getvalue()


def npy_seeds():
    rng = np.random.default_rng(0)
    out("npy", "f32_4d", npy_bytes(rng.standard_normal((1, 2, 3, 4)).astype("<f4")))
    out("npy", "f64_2d", npy_bytes(rng.standard_normal((2, 3)).astype("<f8")))
    out("npy", "f16_1d", npy_bytes(rng.standard_normal(5).astype("<f2")))
    out("npy", "bool", npy_bytes(np.array([[True, False], [False, True]])))
    out("npy", "i4_be", npy_bytes(np.arange(6, dtype=">i4").reshape(2, 3)))
    out("npy", "i8_fortran", npy_bytes(np.asfortranarray(np.arange(6, dtype="<i8").reshape(2, 3))))
    out("npy", "scalar", npy_bytes(np.array(1.5, dtype="<f4")))
    out("npy", "empty", npy_bytes(np.zeros((0, 3), dtype="<f4")))
    out("npy", "v2", npy_bytes(np.ones((2, 2), dtype="<f4"), version=(2, 0)))
    out("npy", "v3", npy_bytes(np.ones((3,), dtype="<f4"), version=(3, 0)))


def safetensors_bytes(tensors, metadata=None):
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def safetensors_seeds():
    f32 = np.arange(6, dtype="<f4").tobytes()
    out("safetensors", "one_f32", safetensors_bytes({"w": ("F32", (2, 3), f32)}))
    out("safetensors", "mixed", safetensors_bytes({
        "a": ("F16", (2,), np.ones(2, dtype="<f2").tobytes()),
        "b": ("BF16", (1, 2), b"\x80\x3f\x00\x40"),
        "c": ("I64", (1,), struct.pack("<q", 7)),
        "d": ("BOOL", (3,), b"\x01\x00\x01"),
        "e": ("F64", (), struct.pack("<d", 2.5)),
        "f": ("U8", (2,), b"\x01\x02"),
    }, {"num_heads": "2", "format": "pt"}))
    out("safetensors", "empty_tensor", safetensors_bytes({"z": ("F32", (0, 4), b"")}))
    out("safetensors", "no_tensors", safetensors_bytes({}, {"k": "v"}))


# A llama2.c model small enough to be a seed: dim 8, hidden 16, 1 layer, 2 heads, 2 KV heads,
# vocab 4, max_seq_len 4 (head_dim 4, kv_dim 8).
CFG = dict(dim=8, hidden=16, layers=1, heads=2, kv_heads=2, vocab=4, seq=4)


def floats(n, seed):
    return np.random.default_rng(seed).standard_normal(n).astype("<f4").tobytes()


def llama_counts(c):
    d, h, L, V = c["dim"], c["hidden"], c["layers"], c["vocab"]
    kv = c["kv_heads"] * (d // c["heads"])
    return dict(emb=V * d, rms=L * d, wq=L * d * d, wk=L * kv * d, wv=L * kv * d, wo=L * d * d,
                w1=L * h * d, w2=L * d * h, w3=L * h * d, final=d, rope=c["seq"] * (d // c["heads"]))


def llama_seeds():
    c = CFG
    n = llama_counts(c)
    fields = [c["dim"], c["hidden"], c["layers"], c["heads"], c["kv_heads"], c["vocab"], c["seq"]]
    # Version 0 (legacy): 7 int32, then float32 weights in llama2.c's order, RoPE tables included.
    v0 = struct.pack("<7i", *fields)
    for i, k in enumerate(["emb", "rms", "wq", "wk", "wv", "wo", "rms", "w1", "w2", "w3", "final", "rope"]):
        v0 += floats(n[k], i)
    out("llama2c", "v0", v0)
    # The same with an unshared classifier (negative vocab_size) appended.
    v0u = struct.pack("<7i", *fields[:5], -c["vocab"], c["seq"]) + v0[28:] + floats(n["emb"], 99)
    out("llama2c", "v0_unshared", v0u)

    def header(version, shared, group=None):
        h = struct.pack("<Ii7iB", 0x616B3432, version, *fields, 1 if shared else 0)
        if group is not None:
            h += struct.pack("<i", group)
        return h + b"\0" * (256 - len(h))

    norms = floats(n["rms"], 1) + floats(n["rms"], 2) + floats(n["final"], 3)
    mats = ["emb", "wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    v1 = header(1, True) + norms + b"".join(floats(n[k], 10 + i) for i, k in enumerate(mats))
    out("llama2c", "v1", v1)
    group = 8

    def q80(count, seed):
        q = np.random.default_rng(seed).integers(-127, 128, count, dtype=np.int8).tobytes()
        return q + np.full(count // group, 0.01, dtype="<f4").tobytes()

    v2 = header(2, True, group) + norms + b"".join(q80(n[k], 20 + i) for i, k in enumerate(mats))
    out("llama2c", "v2_q80", v2)


def tokenizer_file(pieces, max_len):
    b = struct.pack("<i", max_len)
    for text, score in pieces:
        b += struct.pack("<fi", score, len(text)) + text
    return b


def tokenizer_seeds():
    pieces = [(b"<unk>", 0.0), (b"\n<s>\n", 0.0), (b"\n</s>\n", 0.0)]
    pieces += [(b"<0x%02X>" % i, 0.0) for i in range(256)]
    merges = [b" ", b"e", b"t", b"h", b"th", b"the", b" the", b"a", b"n", b"an", b" a", b"\xe2\x9c\x93"]
    pieces += [(m, -float(i)) for i, m in enumerate(merges)]
    # Mode byte 0 (even): the rest is a tokenizer.bin to parse.
    out("tokenizer", "vocab_small", b"\x00" + tokenizer_file(pieces, 8))
    # Mode byte 1 (odd): the rest is a text for the real tok512 vocabulary.
    texts = [b"Once upon a time, there was a little girl named Lily.",
             b"Hello  world\n\ttabs and  spaces ",
             "caf\u00e9 \u2713 \U0001f600 \u00fc\u00df".encode(),
             b"\xff\xfe invalid \xc3 utf-8 \xe2\x82",
             b"<0x41> <s> </s> <unk>",
             b" "]
    for i, t in enumerate(texts):
        out("tokenizer", "text%d" % i, b"\x01" + t)


if __name__ == "__main__":
    npy_seeds()
    safetensors_seeds()
    llama_seeds()
    tokenizer_seeds()
