"""The options of one attention call: checked in one place, handed to C++ as one object.

`values()` is the one place where the options of every entry point (qkv.attention,
attention_backward, explain_dispatch, explain, the PyTorch functions and operators, the layers) are
checked by type and value; it gives them as a tuple in FIELDS' order (the defaults resolved, align
in one spelling), which `options()` turns into a `qkv._qkv.Options`, converted to
`qkv::AttentionParams` in one place in the extension (python/src/options.cpp). The Options of
recent values are kept, so a call with the options of an earlier call passes an existing object.

Adding an option:
  - a scalar (as keep_first; dropout's p, seed and offset would be): a row of FIELDS, its check in values(), the
    keyword of the public functions that take it; in the extension the field of `Options`
    (python/src/options.hpp), its constructor argument and property, and its line in `params_of`.
    The custom operators (qkv/torch.py) take it as one more keyword-only argument with its default.
  - an array (as the attention sinks and ALiBi slopes): a row of ARRAY_OPTIONS (whether it gets a gradient)
    and of `kArrayOptions` (python/src/options.hpp), its check where the arrays tuple is made
    (qkv/_ops.py, arrays()), and the keyword. The custom operators take it as one more optional
    tensor after the existing ones; their autograd formula returns its gradient (the backward
    operator's next output) or None, as ARRAY_OPTIONS says.
"""
import atexit
import difflib
import inspect
import numbers
import operator

import numpy as np

from . import _qkv

# The defaults of the public signatures, as objects: values() passes them on identity.
ALIGN, WINDOW, SOFTCAP, LAYOUT, KERNEL = "bottom-right", (-1, -1), 0.0, "bhsd", "auto"

# (name, type in the custom operators' schema, default) of each field of _qkv.Options.
FIELDS = (
    ("scale", "float?", None),  # None: 1/sqrt(D), resolved by the C++ library
    ("softcap", "float", SOFTCAP),
    ("causal", "bool", False),
    ("align", "str", ALIGN),
    ("window_left", "int", WINDOW[0]),
    ("window_right", "int", WINDOW[1]),
    ("layout", "str", LAYOUT),
    ("kernel_name", "str", KERNEL),  # the keyword `kernel` (a name inductor's fallback calls cannot take)
    ("num_threads", "int", 0),
    ("keep_first", "int", 0),  # StreamingLLM's sink keys 0 .. keep_first-1 (window_keep_first)
)
NAMES = tuple(name for name, _, _ in FIELDS)

# (name, whether it gets a gradient) of each array option, in the order of the `arrays` tuple
# that every C++ entry point takes.
ARRAY_OPTIONS = (("mask", False), ("kv_lens", False), ("sinks", True), ("alibi_slopes", False))
if tuple(name for name, _ in ARRAY_OPTIONS) != _qkv.ARRAY_OPTIONS:
    raise ImportError(f"qkv._qkv takes the arrays {_qkv.ARRAY_OPTIONS}, qkv._options names "
                      f"{tuple(name for name, _ in ARRAY_OPTIONS)}: the extension and the package differ")
NO_ARRAYS = (None,) * len(ARRAY_OPTIONS)

_CHOICES = {  # an option taking one of a few strings: accepted spellings -> its one spelling, message
    "align": ({"bottom-right": ALIGN, "bottom_right": ALIGN, "top-left": "top-left", "top_left": "top-left"},
              "'bottom-right' or 'top-left'"),
    "layout": ({"bhsd": LAYOUT, "bshd": "bshd"}, "'bhsd' or 'bshd'"),
    "kernel": ({"auto": KERNEL, "reference": "reference", "flash": "flash", "decode": "decode"},
               "'auto', 'reference', 'flash' or 'decode'"),
}


def values(scale=None, causal=False, align=ALIGN, window=WINDOW, softcap=SOFTCAP, layout=LAYOUT, kernel=KERNEL,
           num_threads=None, keep_first=0, names=None):
    """The options of one call, checked, as the tuple of FIELDS' values (each of its field's exact
    type; align in one spelling): the key of options(), and the custom operators' keyword
    arguments as dict(zip(NAMES, key)). Pure Python, so torch.compile traces it.

    Args: as qkv.attention; names: the caller's names of the options where they differ (e.g.
      {"causal": "is_causal"} for scaled_dot_product_attention), for the error messages.
    Raises:
      TypeError naming the option: scale or softcap not a real number (a 0-d array or tensor of a
        real dtype is one), causal not a bool (or 0/1), num_threads not an integer or None,
        keep_first not an integer, align, layout or kernel not a str.
      ValueError naming the option: window not a pair of integers (1.7 is refused, not truncated),
        an unknown align, layout or kernel, keep_first < 0.
    """
    # The defaults (the objects of the signatures) and the common types pass with a comparison
    # each; the helpers below convert or refuse the rest.
    if scale is not None and type(scale) is not float:
        scale = _real(_named(names, "scale"), scale)
    if type(causal) is not bool:
        causal = _flag(_named(names, "causal"), causal)
    if align is not ALIGN:
        align = _choice(names, "align", align)
    if window is WINDOW:
        wl = wr = -1
    elif type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int:
        wl, wr = window
    else:
        wl, wr = _window(_named(names, "window"), window)
    if softcap is not SOFTCAP and type(softcap) is not float:
        softcap = _real(_named(names, "softcap"), softcap)
    if layout is not LAYOUT:
        layout = _choice(names, "layout", layout)
    if kernel is not KERNEL:
        kernel = _choice(names, "kernel", kernel)
    if num_threads is None:
        num_threads = 0
    elif type(num_threads) is not int:
        num_threads = _integer(_named(names, "num_threads"), num_threads)
    if type(keep_first) is not int:
        keep_first = _integer(_named(names, "keep_first"), keep_first, "an integer >= 0")
    if keep_first < 0:
        raise ValueError(f"{_named(names, 'keep_first')}: expected an integer >= 0 (the number of leading keys every "
                         f"query sees besides its window), got {keep_first}")
    return (scale, softcap, causal, align, wl, wr, layout, kernel, num_threads, keep_first)


# The Options of recent keys. Keys are values() results, whose exact types keep 1, 1.0 and True
# (equal in Python) apart; a NaN scale (never equal to itself) adds entries, hence the bound.
KEPT = {}
_KEPT_MAX = 256
atexit.register(KEPT.clear)  # before the extension is torn down, which counts its live objects


def options(key):
    """The _qkv.Options of a values() key: `KEPT.get(key) or options(key)` is the call's fast path."""
    o = KEPT.get(key)
    if o is None:
        o = _qkv.Options(**dict(zip(NAMES, key)))
        if len(KEPT) >= _KEPT_MAX:
            KEPT.clear()
        KEPT[key] = o
    return o


def _choice(names, name, x):
    table, expected = _CHOICES[name]
    if type(x) is not str:
        raise TypeError(f"{_named(names, name)}: expected a str ({expected}), got {type(x).__name__} {x!r}")
    if x not in table:
        raise ValueError(f"{_named(names, name)}: expected {expected}, got {x!r}")
    return table[x]


def _named(names, name):
    return name if names is None else names.get(name, name)


def _real(name, x):
    """A float option (scale, softcap) as a Python float: a real number, or a 0-d NumPy array or
    PyTorch tensor of a real dtype; TypeError naming it otherwise (a string is not taken)."""
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return float(x)
    if getattr(x, "ndim", None) == 0 and not isinstance(x, (str, bytes)):
        dt = str(getattr(x, "dtype", ""))
        if any(t in dt for t in ("float", "int")) and "bool" not in dt:
            return float(x)
    raise TypeError(f"{name}: expected a real number, got {type(x).__name__} {x!r}")


def _flag(name, x):
    """A bool option (causal): a bool (NumPy's too) or the integers 0 and 1; TypeError naming it
    otherwise (a string such as "no" would otherwise read as True)."""
    if isinstance(x, (bool, np.bool_)) or (type(x) is int and x in (0, 1)):
        return bool(x)
    raise TypeError(f"{name}: expected a bool, got {type(x).__name__} {x!r}")


def _integer(name, x, expected="an integer or None"):
    """An integer option (num_threads, keep_first): an integer of any kind (not a bool, not a float)."""
    if not isinstance(x, (bool, np.bool_)):
        try:
            return operator.index(x)
        except TypeError:
            pass
    raise TypeError(f"{name}: expected {expected}, got {type(x).__name__} {x!r}")


def _window(name, window):
    """(left, right) as ints; ValueError naming the argument for anything but a pair of integers
    (1.7 is refused, not truncated; NumPy and PyTorch integers are integers)."""
    try:
        left, right = window
        if isinstance(left, (bool, np.bool_)) or isinstance(right, (bool, np.bool_)):
            raise TypeError
        return operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a pair of integers (left, right), got {window!r}") from None


def keyword_only(fn):
    """fn, whose signature ends in *positional and **unknown to catch misuse, as it reads without them
    (help(), inspect.signature)."""
    sig = inspect.signature(fn)
    fn.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values()
                                               if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)])
    return fn


def misuse(fn, positional, unknown):
    """TypeError for a call of fn (a function of keyword_only()) with an option passed by position or
    a keyword it does not take, naming the option (and the closest one it takes, for a misspelling)."""
    params = [p for p in fn.__signature__.parameters.values() if p.name != "self"]
    known = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if unknown:
        name = next(iter(unknown))
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(known)}"
        raise TypeError(f"{fn.__qualname__}() got an unexpected keyword argument {name!r}; {hint}")
    leading = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    x = positional[0]
    shape = getattr(x, "shape", None)
    what = f"a {type(x).__name__}" + (f" of shape {list(shape)}" if shape is not None else f" {x!r}")
    raise TypeError(f"{fn.__qualname__}() takes {', '.join(leading)} by position and its options by keyword only; "
                    f"argument {len(leading) + 1} ({what}) was passed by position: name it "
                    f"({', '.join(p.name for p in params if p.kind == p.KEYWORD_ONLY)})")
