#pragma once
// The parts of the _qkv extension module, one function per file.

#include <nanobind/nanobind.h>

namespace qkv::python {

void bind_options(nanobind::module_& m); // options.cpp: Options, ARRAY_OPTIONS
void bind_ops(nanobind::module_& m);     // ops.cpp: attention, attention_backward, explain_dispatch
void bind_layers(nanobind::module_& m);  // layers.cpp: MultiHeadAttention, KVCache
void bind_explain(nanobind::module_& m); // explain.cpp: the five steps as arrays

}  // namespace qkv::python
