"""qkv: exact, fast scaled dot-product attention on the CPU, from NumPy and PyTorch.

    import numpy as np, qkv
    q = k = v = np.random.rand(1, 8, 128, 64).astype(np.float32)   # [B, H, S, D]
    out = qkv.attention(q, k, v, causal=True)

Functions on arrays (NumPy arrays or PyTorch CPU tensors, zero-copy):
    attention, attention_backward, explain_dispatch, explain; alibi_slopes (BLOOM's ALiBi slopes)
Layers: MultiHeadAttention (loads a torch.nn.MultiheadAttention state_dict), KVCache
PyTorch (imported on first use): qkv.torch.scaled_dot_product_attention, qkv.flash_attn_func,
    the custom operators torch.ops.qkv.attention and torch.ops.qkv.attention_backward.
Hugging Face transformers (imported on first use): qkv.transformers.register() adds
    attn_implementation="qkv".
Benchmark: python -m qkv.bench.  Documentation: docs/python.md.
"""
from . import _qkv
from ._explain import explain
from ._layers import KVCache, MultiHeadAttention
from ._ops import alibi_slopes, attention, attention_backward, explain_dispatch

__version__ = _qkv.__version__
__all__ = ["attention", "attention_backward", "explain_dispatch", "explain", "alibi_slopes", "KVCache", "MultiHeadAttention",
           "flash_attn_func", "torch", "transformers"]


def __getattr__(name):
    # PyTorch is imported only when its integration is asked for (importing it takes seconds).
    if name in ("torch", "flash_attn_func", "transformers"):
        import importlib
        mod = importlib.import_module(".transformers" if name == "transformers" else ".torch", __name__)
        return mod.flash_attn_func if name == "flash_attn_func" else mod
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")
