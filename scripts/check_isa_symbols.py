#!/usr/bin/env python3
"""Checks that the ISA-specific objects (src/kernels/simd/<isa>/*.cpp) share no code with the rest.

Each of those files is compiled with its ISA's flags (-mavx512f ...). A function they emit out of
line as a weak symbol (an inline function or template instantiation, such as
std::vector<long>::_M_fill_assign) is merged by the linker with the same function of every other
object, and the linker keeps one copy, which may be the avx512 one: every caller, the avx2 and
scalar code included, then runs avx512 instructions and dies of SIGILL on a CPU without them.
So the only weak symbols these objects may define are in their own engine namespace
(qkv::detail::engine_<isa>, kernels/engine/), whose names no other object defines.

Usage: check_isa_symbols.py OBJECT... (the objects of qkv_attention, as arguments or ;-separated;
those outside src/kernels/simd/ are ignored). Exits 1 with the offending symbols, 0 otherwise.
"""
import os
import re
import subprocess
import sys

# Weak (W, V) and unique global (u) definitions; lower-case w/v are weak references, not definitions.
WEAK_DEFINITIONS = {"W", "V", "u"}
# The compilers' own helpers: the personality routine's indirection cells (data, the same bytes
# in every object; GCC and clang) and clang's __clang_call_terminate (__cxa_begin_catch, then
# std::terminate: no vector instructions whatever the flags).
ALLOWED = {"DW.ref.__gxx_personality_v0", "DW.ref.__gcc_personality_v0", "__clang_call_terminate"}


def isa_of(path):
    m = re.search(r"[/\\]simd[/\\]([a-z0-9]+)[/\\]", path)
    return m.group(1) if m else None


def main(argv):
    # CMake passes $<TARGET_OBJECTS:...> as one ;-separated argument.
    objects = [p for a in argv[1:] for p in a.split(";") if isa_of(p)]
    if not objects:
        print("check_isa_symbols: no objects under src/kernels/simd/ given", file=sys.stderr)
        return 1
    bad = []
    for obj in objects:
        isa = isa_of(obj)
        own = f"qkv::detail::engine_{isa}::"
        out = subprocess.run(["nm", "-C", obj], check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split(maxsplit=2)
            if len(parts) != 3 or parts[1] not in WEAK_DEFINITIONS:
                continue
            name = parts[2]
            # A symbol of the engine namespace, or a template of another namespace instantiated
            # on one of its types, is the ISA's own.
            if name in ALLOWED or own in name:
                continue
            bad.append(f"{os.path.basename(obj)} ({isa}): {name}")
    for b in bad:
        print("check_isa_symbols: shared weak symbol " + b, file=sys.stderr)
    if bad:
        print("check_isa_symbols: move the code out of the ISA file or keep it inline (see the docstring)", file=sys.stderr)
        return 1
    print(f"check_isa_symbols: {len(objects)} ISA objects, no shared weak symbols")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
