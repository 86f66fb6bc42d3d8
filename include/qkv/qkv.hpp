#pragma once
/// @file qkv.hpp
/// Umbrella header: everything public in qkv.
#include "qkv/attention.hpp"
#include "qkv/error.hpp"
#include "qkv/explain.hpp"
#include "qkv/info.hpp"
#include "qkv/kv_cache.hpp"
#include "qkv/llama.hpp"
#include "qkv/llama2c.hpp"
#include "qkv/mha.hpp"
#include "qkv/npy.hpp"
#include "qkv/reference.hpp"
#include "qkv/rope.hpp"
#include "qkv/safetensors.hpp"
#include "qkv/sampler.hpp"
#include "qkv/tensor.hpp"
#include "qkv/tokenizer.hpp"
#include "qkv/version.hpp"
