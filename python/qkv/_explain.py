"""qkv.explain: the five steps of scaled dot-product attention on your q, k, v, as arrays."""
from . import _ops, _options, _qkv
from ._options import ALIGN, LAYOUT, SOFTCAP, WINDOW

KEY_STATUS = ("admitted", "causal/window", "kv_len", "mask")


@_options.keyword_only
def explain(q, k, v, *positional, scale=None, causal=False, align=ALIGN, window=WINDOW, softcap=SOFTCAP,
            mask=None, kv_lens=None, sinks=None, alibi_slopes=None, keep_first=0, layout=LAYOUT, **unknown):
    """The steps of attention(q, k, v, ...), computed in float64 by the reference specification.

    Source: Vaswani et al. 2017, sec. 3.2.1. Arguments as qkv.attention (NumPy or PyTorch CPU
    arrays, any float dtype; at most 2^24 scores). Returns a dict of float64 NumPy arrays:
      "scores"   [B,Hq,Sq,Sk]  1. q_i . k_j (-inf where the key is excluded)
      "scaled"   [B,Hq,Sq,Sk]  2. scale * q.k, softcapped, plus the additive mask: the logits
      "status"   [B,Hq,Sq,Sk]  3. uint8, why a key is excluded: KEY_STATUS[status] is
                               "admitted", "causal/window", "kv_len" or "mask"
      "weights"  [B,Hq,Sq,Sk]  4. softmax of each row over the admitted keys (0 elsewhere); with
                               sinks each row sums to 1 - its sink weight
      "output"   [B,Hq,Sq,Dv]  5. weights @ v (equals qkv.attention's output)
      "softmax_lse" [B,Hq,Sq]  natural log of each row's sum of exp(logit) (-inf: empty row)
      "mask_add" [B,Hq,Sq,Sk]  the additive mask term (zeros without a float mask)
    and "scale", "softcap", "window" (effective (left, right)), "kv_lens"; the score options:
      "sinks" [Hq] and "sink_weights" [B,Hq,Sq] (exp(z_h - lse), each row's sink share), "alibi_slopes"
      [B,Hq] (their bias is in "scaled"), None without them, and "keep_first".
    Raises: TypeError / ValueError as qkv.attention, and ValueError above 2^24 scores.
    """
    if positional or unknown:
        _options.misuse(explain, positional, unknown)
    fw = _ops._framework("q", q)
    _ops._same("k", k, fw, q)
    _ops._same("v", v, fw, q)
    opts = _options.options(_options.values(scale, causal, align, window, softcap, layout, keep_first=keep_first))
    return _qkv._trace(q, k, v, _ops.arrays(fw, mask, kv_lens, sinks, alibi_slopes), opts)
