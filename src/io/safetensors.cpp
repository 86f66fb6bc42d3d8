// safetensors reader and writer. Every header field is checked against the file length and
// against the other entries before a tensor is allocated, so a hostile file yields a qkv::Error,
// never an out-of-bounds read or a huge allocation.
#include "qkv/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "io/atomic_file.hpp"
#include "io/mapped_file.hpp"
#include "qkv/error.hpp"
#include "qkv/npy.hpp"
#include "tensor/convert.hpp"

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

namespace qkv {
namespace {

constexpr std::uint64_t kMaxHeader = 100'000'000;  // the limit of the reference implementation
constexpr int kMaxDepth = 64;

using json = nlohmann::json;

[[noreturn]] void fail(const std::string& file, const std::string& what) {
  throw Error(file + ": not a valid safetensors file: " + what);
}

// Bytes per element of every dtype the format defines (0 = unknown).
std::size_t itemsize(const std::string& d) {
  static const std::map<std::string, std::size_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},  {"I32", 4},     {"I16", 2},    {"I8", 1},
      {"U64", 8}, {"U32", 4}, {"U16", 2}, {"U8", 1},   {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  auto it = sizes.find(d);
  return it == sizes.end() ? 0 : it->second;
}

// Deepest nesting of [ and { outside strings; stops counting past the limit.
int json_depth(std::string_view s) {
  int depth = 0, max_depth = 0;
  bool in_str = false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (in_str) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_str = false;
    } else if (c == '"') {
      in_str = true;
    } else if (c == '[' || c == '{') {
      max_depth = std::max(max_depth, ++depth);
      if (max_depth > kMaxDepth) return max_depth;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return max_depth;
}

std::string dtype_tag(DType d) {
  switch (d) {
    case DType::f32:
      return "F32";
    case DType::f64:
      return "F64";
    case DType::f16:
      return "F16";
    case DType::bf16:
      return "BF16";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::b8:
      return "BOOL";
    case DType::i8:
      return "I8";
    case DType::u8:
      return "U8";
  }
  return "?";
}

}  // namespace

SafetensorsFile SafetensorsFile::from_bytes(std::shared_ptr<const void> owner, const std::byte* bytes,
                                            std::uint64_t size, const std::string& name) {
  if (size < 8)
    fail(name, "the file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  if (n > kMaxHeader) fail(name, "header length " + std::to_string(n) + " exceeds the 100 MB limit");
  if (n > size - 8)
    fail(name, "header length " + std::to_string(n) + " exceeds the file (" + std::to_string(size - 8) +
                   " bytes after the length)");
  if (n < 2) fail(name, "header length " + std::to_string(n) + " is too short for a JSON object");
  const std::string_view text(reinterpret_cast<const char*>(bytes + 8), static_cast<std::size_t>(n));
  if (text.front() != '{') fail(name, "the header does not start with '{'");
  if (json_depth(text) > kMaxDepth)
    fail(name, "the header nests deeper than " + std::to_string(kMaxDepth) + " levels");

  SafetensorsFile f;
  f.file_ = name;
  f.owner_ = std::move(owner);
  f.data_ = bytes + 8 + n;
  f.data_size_ = size - 8 - n;

  std::set<std::string> seen;
  std::string dup;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::key && depth == 1 && parsed.is_string()) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!seen.insert(k).second && dup.empty()) dup = k;
    }
    return true;
  };
  json h;
  try {
    h = json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/false);
  } catch (const json::exception& e) {
    fail(name, std::string("malformed JSON header: ") + e.what());
  }
  if (h.is_discarded()) fail(name, "malformed JSON header");
  if (!h.is_object()) fail(name, "the header is not a JSON object");
  if (!dup.empty()) fail(name, "the name '" + dup + "' appears twice in the header");

  try {
    for (auto it = h.begin(); it != h.end(); ++it) {
      const std::string& key = it.key();
      const json& v = it.value();
      if (key == "__metadata__") {
        if (!v.is_object()) fail(name, "__metadata__ is not an object");
        for (auto m = v.begin(); m != v.end(); ++m) {
          if (!m.value().is_string()) fail(name, "__metadata__ value of '" + m.key() + "' is not a string");
          f.metadata_[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      const std::string where = "tensor '" + key + "': ";
      if (!v.is_object()) fail(name, where + "the entry is not an object");
      if (!v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
        fail(name, where + "expected the fields dtype, shape and data_offsets");
      const json &jd = v["dtype"], &js = v["shape"], &jo = v["data_offsets"];
      if (!jd.is_string()) fail(name, where + "dtype is not a string");
      SafetensorsEntry e;
      e.dtype = jd.get<std::string>();
      const std::size_t es = itemsize(e.dtype);
      if (!es) fail(name, where + "unknown dtype '" + e.dtype + "'");
      if (!js.is_array()) fail(name, where + "shape is not an array");
      for (const json& d : js) {
        if (!d.is_number_unsigned() ||
            d.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
          fail(name, where + "shape " + js.dump() + " holds a dimension that is not a non-negative integer");
        e.shape.push_back(static_cast<std::int64_t>(d.get<std::uint64_t>()));
      }
      if (e.shape.size() > 32) fail(name, where + "more than 32 dimensions");
      if (!jo.is_array() || jo.size() != 2 || !jo[0].is_number_unsigned() || !jo[1].is_number_unsigned())
        fail(name, where + "data_offsets is not a pair of non-negative integers");
      e.begin = jo[0].get<std::uint64_t>();
      e.end = jo[1].get<std::uint64_t>();
      if (e.begin > e.end)
        fail(name, where + "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                       "] has begin > end");
      if (e.end > f.data_size_)
        fail(name, where + "data_offsets end " + std::to_string(e.end) + " is beyond the data buffer (" +
                       std::to_string(f.data_size_) + " bytes)");
      std::int64_t numel = 0;
      try {
        numel = checked_numel(e.shape, es, name);
      } catch (const Error&) {
        fail(name, where + "the element count of shape " + shape_str(e.shape) + " overflows");
      }
      if (static_cast<std::uint64_t>(numel) * es != e.end - e.begin)
        fail(name, where + "shape " + shape_str(e.shape) + " of " + e.dtype + " needs " +
                       std::to_string(static_cast<std::uint64_t>(numel) * es) + " bytes, data_offsets span " +
                       std::to_string(e.end - e.begin));
      f.entries_.emplace(key, std::move(e));
    }
  } catch (const json::exception& ex) {
    fail(name, std::string("unexpected JSON content: ") + ex.what());
  }

  // Byte ranges may not overlap (empty tensors occupy nothing).
  std::vector<std::pair<const std::string*, const SafetensorsEntry*>> order;
  for (const auto& [k, e] : f.entries_) order.emplace_back(&k, &e);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return a.second->begin != b.second->begin ? a.second->begin < b.second->begin : *a.first < *b.first;
  });
  const std::pair<const std::string*, const SafetensorsEntry*>* prev = nullptr;
  for (const auto& o : order) {
    if (o.second->begin == o.second->end) {
      f.names_.push_back(*o.first);
      continue;
    }
    if (prev && o.second->begin < prev->second->end)
      fail(name, "the data of tensors '" + *prev->first + "' [" + std::to_string(prev->second->begin) + ", " +
                     std::to_string(prev->second->end) + ") and '" + *o.first + "' [" +
                     std::to_string(o.second->begin) + ", " + std::to_string(o.second->end) + ") overlap");
    prev = &o;
    f.names_.push_back(*o.first);
  }
  return f;
}

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  const std::string name = path.string();
  auto file = std::make_shared<const detail::MappedFile>(path);
  const std::span<const std::byte> bytes = file->bytes();
  if (bytes.size() < 8)
    fail(name, "the file is " + std::to_string(bytes.size()) + " bytes, shorter than the 8-byte header length");
  return from_bytes(std::shared_ptr<const void>(file, bytes.data()), bytes.data(), bytes.size(), name);
}

SafetensorsFile SafetensorsFile::parse(std::span<const std::byte> bytes, const std::string& name) {
  auto copy = std::make_shared<std::vector<std::byte>>(bytes.begin(), bytes.end());
  const std::byte* p = copy->data();
  return from_bytes(std::shared_ptr<const void>(copy, copy.get()), p, copy->size(), name);
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) throw Error(file_ + ": no tensor named '" + name + "'");
  return it->second;
}

Tensor SafetensorsFile::load(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  DType src;
  if (e.dtype == "F32")
    src = DType::f32;
  else if (e.dtype == "F64")
    src = DType::f64;
  else if (e.dtype == "F16")
    src = DType::f16;
  else if (e.dtype == "BF16")
    src = DType::bf16;
  else if (e.dtype == "I32")
    src = DType::i32;
  else if (e.dtype == "I64")
    src = DType::i64;
  else if (e.dtype == "BOOL")
    src = DType::b8;
  else
    throw Error(file_ + ": tensor '" + name + "': dtype " + e.dtype +
                " is not supported (expected F32, F16, BF16, F64, I32, I64 or BOOL)");
  // Copy first: the data may sit at any alignment inside the file.
  Tensor raw(src, e.shape);
  if (e.end > e.begin) std::memcpy(raw.data(), data_ + e.begin, static_cast<std::size_t>(e.end - e.begin));
  if (!detail::is_float_dtype(src) || src == DType::f32) return raw;
  Tensor out(DType::f32, e.shape);
  detail::convert_row(raw.data(), src, out.data(), DType::f32, raw.numel());
  return out;
}

std::map<std::string, Tensor> SafetensorsFile::load_all() const {
  std::map<std::string, Tensor> m;
  for (const auto& n : names_) m.emplace(n, load(n));
  return m;
}

std::map<std::string, Tensor> read_safetensors(const std::filesystem::path& path) {
  return SafetensorsFile::open(path).load_all();
}

void write_safetensors(const std::filesystem::path& path,
                       const std::vector<std::pair<std::string, TensorView>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::uint64_t off = 0;
  std::set<std::string> names;
  for (const auto& [n, t] : tensors) {
    if (n.empty() || n == "__metadata__")
      throw Error(path.string() + ": tensor name '" + n + "' is not allowed");
    if (!names.insert(n).second) throw Error(path.string() + ": tensor name '" + n + "' given twice");
    const std::uint64_t bytes =
        static_cast<std::uint64_t>(checked_numel(t.shape(), dtype_size(t.dtype()), n)) *
        dtype_size(t.dtype());
    if (!t.data() && bytes) throw Error(path.string() + ": tensor '" + n + "': data pointer is null");
    h[n] = {{"dtype", dtype_tag(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {off, off + bytes}}};
    off += bytes;
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // keeps the data buffer 8-byte aligned

  detail::write_file_atomically(path, [&](std::ostream& f) {
    unsigned char len[8];
    for (int i = 0; i < 8; ++i)
      len[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(header.size()) >> (8 * i));
    f.write(reinterpret_cast<const char*>(len), 8);
    f.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (const auto& [n, t] : tensors) {
      const Tensor c = t.is_contiguous() ? Tensor() : to_contiguous(t, t.dtype());
      const void* src = t.is_contiguous() ? t.data() : c.data();
      const auto bytes =
          static_cast<std::streamsize>(t.numel() * static_cast<std::int64_t>(dtype_size(t.dtype())));
      if (bytes) f.write(static_cast<const char*>(src), bytes);
    }
  });
}

std::map<std::string, Tensor> read_weights(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    std::map<std::string, Tensor> m;
    for (const auto& de : std::filesystem::directory_iterator(path)) {
      const auto& p = de.path();
      if (!de.is_regular_file() || p.extension() != ".npy") continue;
      const NpyArray a = read_npy(p);
      const DType to = detail::is_float_dtype(a.dtype()) ? DType::f32 : a.dtype();
      m.emplace(p.stem().string(), to_contiguous(a.view(), to));
    }
    if (m.empty()) throw Error(path.string() + ": the directory holds no .npy files");
    return m;
  }
  if (!std::filesystem::exists(path, ec)) throw Error(path.string() + ": no such file or directory");
  return read_safetensors(path);
}

}  // namespace qkv
