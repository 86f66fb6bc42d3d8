"""qkv.explain: the five steps of scaled dot-product attention on your q, k, v, as arrays."""
import numpy as np

from . import _ops, _qkv

KEY_STATUS = ("admitted", "causal/window", "kv_len", "mask")


def explain(q, k, v, *, scale=None, causal=False, align="bottom-right", window=(-1, -1), softcap=0.0, mask=None,
            kv_lens=None, layout="bhsd"):
    """The steps of attention(q, k, v, ...), computed in float64 by the reference specification.

    Source: Vaswani et al. 2017, sec. 3.2.1. Arguments as qkv.attention (NumPy or PyTorch CPU
    arrays, any float dtype; at most 2^24 scores). Returns a dict of float64 NumPy arrays:
      "scores"   [B,Hq,Sq,Sk]  1. q_i . k_j (-inf where the key is excluded)
      "scaled"   [B,Hq,Sq,Sk]  2. scale * q.k, softcapped, plus the additive mask: the logits
      "status"   [B,Hq,Sq,Sk]  3. uint8, why a key is excluded: KEY_STATUS[status] is
                               "admitted", "causal/window", "kv_len" or "mask"
      "weights"  [B,Hq,Sq,Sk]  4. softmax of each row over the admitted keys (0 elsewhere)
      "output"   [B,Hq,Sq,Dv]  5. weights @ v (equals qkv.attention's output)
      "softmax_lse" [B,Hq,Sq]  natural log of each row's sum of exp(logit) (-inf: empty row)
      "mask_add" [B,Hq,Sq,Sk]  the additive mask term (zeros without a float mask)
    and "scale", "softcap", "window" (effective (left, right)), "kv_lens".
    Raises: TypeError / ValueError as qkv.attention, and ValueError above 2^24 scores.
    """
    fw = _ops._framework("q", q)
    _ops._same("k", k, fw, q)
    _ops._same("v", v, fw, q)
    bshd = _ops._layout(layout)
    wl, wr = _ops._window(window)
    scale, softcap, causal = _ops._scalars(scale, softcap, causal)
    if fw == "torch":
        q, k, v = _ops._detach(q), _ops._detach(k), _ops._detach(v)
    return _qkv._trace(q, k, v, bshd, scale, float(softcap), bool(causal), align, wl, wr, _ops._aux("mask", mask, fw),
                       _ops._aux("kv_lens", kv_lens, fw))
