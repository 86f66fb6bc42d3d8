#pragma once
/// @file qkv.hpp
/// Umbrella header: everything public in qkv.
#include "qkv/attention.hpp"
#include "qkv/error.hpp"
#include "qkv/info.hpp"
#include "qkv/llama2c.hpp"
#include "qkv/npy.hpp"
#include "qkv/reference.hpp"
#include "qkv/tensor.hpp"
#include "qkv/tokenizer.hpp"
#include "qkv/version.hpp"
