#pragma once
/// @file qkv.hpp
/// Umbrella header: everything public in qkv.
#include "qkv/attention.hpp"
#include "qkv/error.hpp"
#include "qkv/explain.hpp"
#include "qkv/info.hpp"
#include "qkv/npy.hpp"
#include "qkv/reference.hpp"
#include "qkv/tensor.hpp"
#include "qkv/version.hpp"
