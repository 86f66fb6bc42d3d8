#pragma once
/// @file safetensors.hpp
/// Reading and writing safetensors files (named tensors, as saved by PyTorch / Hugging Face).
///
/// Format (https://huggingface.co/docs/safetensors, "Format"): an 8-byte little-endian unsigned
/// header length N, N bytes of UTF-8 JSON (an object: tensor name -> {"dtype", "shape",
/// "data_offsets": [begin, end]}, plus an optional "__metadata__" object of string -> string),
/// then the data buffer; offsets are relative to the start of the buffer, data is little-endian
/// and C-contiguous.
///
/// Reading validates everything before any tensor is allocated; each of these is a qkv::Error
/// naming the file (and the tensor): a file shorter than 8 bytes, N beyond 100 MB or beyond the
/// file, malformed JSON (parsed with nlohmann-json; nesting deeper than 64 refused before parsing),
/// a duplicate name, an entry that is not an object, an unknown dtype, a shape with negative or
/// non-integer dimensions or an element count that overflows, offsets that are not two unsigned
/// integers with begin <= end, end - begin != numel * itemsize, an end beyond the data buffer, or
/// two tensors whose byte ranges overlap.
///
/// dtypes read: F32, F16, BF16 and F64 are converted to float32 at load; I32, I64 and BOOL keep
/// their type; other valid dtypes (I8, U8, I16, U16, U32, U64, F8_*) are indexed and validated
/// but load() refuses them.

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "qkv/tensor.hpp"

namespace qkv {

/// One entry of a safetensors header.
struct SafetensorsEntry {
  std::string dtype;  ///< as in the file: "F32", "BF16", ...
  Shape shape;
  std::uint64_t begin = 0, end = 0;  ///< byte range in the data buffer
};

/// An opened, validated safetensors file. Cheap to copy (the bytes are shared).
class SafetensorsFile {
 public:
  /// Opens and validates `path` (memory-mapped). @throws qkv::Error as described above.
  static SafetensorsFile open(const std::filesystem::path& path);
  /// Validates bytes held in memory (copied). `name` is used in messages.
  static SafetensorsFile parse(std::span<const std::byte> bytes, const std::string& name = "<memory>");

  /// Tensor names in order of their data offsets.
  const std::vector<std::string>& names() const noexcept { return names_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  /// @throws qkv::Error naming the file and the tensor if absent.
  const SafetensorsEntry& entry(const std::string& name) const;
  /// The "__metadata__" object (empty if absent).
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }

  /// Loads one tensor into a new C-contiguous Tensor: float types become float32, I32/I64/BOOL
  /// keep their type. @throws qkv::Error for an absent name or an unsupported dtype.
  Tensor load(const std::string& name) const;
  /// Every tensor, loaded as load() does.
  std::map<std::string, Tensor> load_all() const;

 private:
  std::string file_;
  std::shared_ptr<const void> owner_;
  const std::byte* data_ = nullptr;  // start of the data buffer
  std::uint64_t data_size_ = 0;
  std::map<std::string, SafetensorsEntry> entries_;
  std::vector<std::string> names_;
  std::map<std::string, std::string> metadata_;
  static SafetensorsFile from_bytes(std::shared_ptr<const void> owner, const std::byte* bytes,
                                    std::uint64_t size, const std::string& name);
};

/// Reads every tensor of a safetensors file (see SafetensorsFile::load for dtypes).
std::map<std::string, Tensor> read_safetensors(const std::filesystem::path& path);

/// Writes named tensors (any strides; dtypes float32, float64, float16, bfloat16, int32, int64,
/// bool) and string metadata as a safetensors file, atomically (temporary file + rename: a
/// failure leaves no partial file). Names must be unique, non-empty and not "__metadata__".
/// @throws qkv::Error for a bad name or an I/O failure.
void write_safetensors(const std::filesystem::path& path,
                       const std::vector<std::pair<std::string, TensorView>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

/// Reads named weights from `path`: a .safetensors file, or a directory whose `<name>.npy` files
/// each hold the tensor `<name>` (e.g. `in_proj_weight.npy`, `out_proj.weight.npy`). Float
/// tensors become float32. @throws qkv::Error for a missing path, an empty directory, or any
/// file the readers refuse.
std::map<std::string, Tensor> read_weights(const std::filesystem::path& path);

}  // namespace qkv
