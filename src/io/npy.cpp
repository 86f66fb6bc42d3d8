// .npy reader and writer (NumPy format versions 1.0-3.0).
// Every size in the header is checked against the file length before anything is allocated.
#include "qkv/npy.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "io/atomic_file.hpp"
#include "qkv/error.hpp"

namespace qkv {
namespace {

constexpr std::size_t kMaxHeaderLen = 1u << 20;  // numpy itself refuses headers beyond 10 KiB+

struct Header {
  DType dtype = DType::f32;
  bool swap = false;  // big-endian data
  bool fortran = false;
  Shape shape;
  std::size_t data_offset = 0;
  std::int64_t numel = 0;
};

[[noreturn]] void fail(const std::string& name, const std::string& what) {
  throw Error(name + ": not a valid .npy file: " + what);
}

// A tiny parser for the header's Python dict literal, e.g.
// {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
class DictParser {
public:
  DictParser(std::string_view s, const std::string& name) : s_(s), name_(name) {}
  void ws() { while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_; }
  bool eat(char c) { ws(); if (i_ < s_.size() && s_[i_] == c) { ++i_; return true; } return false; }
  void expect(char c) { if (!eat(c)) fail(name_, std::string("header: expected '") + c + "' at offset " + std::to_string(i_)); }
  std::string str() {
    ws();
    if (i_ >= s_.size() || (s_[i_] != '\'' && s_[i_] != '"')) fail(name_, "header: expected a string at offset " + std::to_string(i_));
    const char q = s_[i_++];
    const std::size_t start = i_;
    while (i_ < s_.size() && s_[i_] != q) ++i_;
    if (i_ >= s_.size()) fail(name_, "header: unterminated string");
    return std::string(s_.substr(start, i_++ - start));
  }
  bool boolean() {
    ws();
    if (s_.substr(i_, 4) == "True") { i_ += 4; return true; }
    if (s_.substr(i_, 5) == "False") { i_ += 5; return false; }
    fail(name_, "header: expected True or False for 'fortran_order'");
  }
  Shape tuple() {
    expect('(');
    Shape sh;
    while (!eat(')')) {
      ws();
      bool neg = false;
      if (i_ < s_.size() && s_[i_] == '-') { neg = true; ++i_; }
      if (i_ >= s_.size() || s_[i_] < '0' || s_[i_] > '9') fail(name_, "header: expected an integer in 'shape'");
      std::int64_t v = 0;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
        const int digit = s_[i_++] - '0';
        if (v > (std::numeric_limits<std::int64_t>::max() - digit) / 10) fail(name_, "header: a dimension in 'shape' overflows int64");
        v = v * 10 + digit;
      }
      if (i_ < s_.size() && s_[i_] == 'L') ++i_;  // Python 2 long suffix
      if (neg) fail(name_, "header: negative dimension -" + std::to_string(v) + " in 'shape'");
      sh.push_back(v);
      if (sh.size() > 32) fail(name_, "header: more than 32 dimensions in 'shape'");
      if (!eat(',')) { expect(')'); break; }
    }
    return sh;
  }

private:
  std::string_view s_;
  const std::string& name_;
  std::size_t i_ = 0;
};

Header parse_header(const std::byte* bytes, std::size_t avail, std::uint64_t file_size, const std::string& name) {
  if (avail < 10) fail(name, "file is " + std::to_string(file_size) + " bytes, shorter than the 10-byte preamble");
  static const unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (std::memcmp(bytes, magic, 6) != 0) fail(name, "bad magic (expected \\x93NUMPY)");
  const auto major = static_cast<unsigned>(bytes[6]), minor = static_cast<unsigned>(bytes[7]);
  std::size_t hlen = 0, pre = 0;
  if (minor != 0) {
    // numpy itself reads only 1.0, 2.0 and 3.0; another minor version is a format we do not know.
    fail(name, "unsupported format version " + std::to_string(major) + "." + std::to_string(minor) + " (expected 1.0, 2.0 or 3.0)");
  } else if (major == 1) {
    hlen = static_cast<std::size_t>(bytes[8]) | static_cast<std::size_t>(bytes[9]) << 8;
    pre = 10;
  } else if (major == 2 || major == 3) {
    if (avail < 12) fail(name, "truncated preamble");
    hlen = 0;
    for (int b = 0; b < 4; ++b) hlen |= static_cast<std::size_t>(bytes[8 + b]) << (8 * b);
    pre = 12;
  } else {
    fail(name, "unsupported format version " + std::to_string(major) + "." + std::to_string(minor) + " (expected 1.0, 2.0 or 3.0)");
  }
  if (hlen > kMaxHeaderLen) fail(name, "header length " + std::to_string(hlen) + " exceeds the 1 MiB limit");
  if (pre + hlen > avail) fail(name, "truncated header (" + std::to_string(hlen) + " bytes declared, file has " + std::to_string(file_size) + ")");
  std::string_view text(reinterpret_cast<const char*>(bytes + pre), hlen);

  Header h;
  h.data_offset = pre + hlen;
  DictParser dp(text, name);
  bool have_descr = false, have_order = false, have_shape = false;
  std::string descr;
  dp.expect('{');
  while (!dp.eat('}')) {
    const std::string key = dp.str();
    dp.expect(':');
    if (key == "descr") { descr = dp.str(); have_descr = true; }
    else if (key == "fortran_order") { h.fortran = dp.boolean(); have_order = true; }
    else if (key == "shape") { h.shape = dp.tuple(); have_shape = true; }
    else fail(name, "header: unknown key '" + key + "'");
    if (!dp.eat(',')) { dp.expect('}'); break; }
  }
  if (!have_descr || !have_order || !have_shape) fail(name, "header: missing 'descr', 'fortran_order' or 'shape'");

  if (descr.size() != 3) fail(name, "unsupported dtype '" + descr + "'");
  const char endian = descr[0];
  const std::string code = descr.substr(1);
  if (code == "f4") h.dtype = DType::f32;
  else if (code == "f8") h.dtype = DType::f64;
  else if (code == "f2") h.dtype = DType::f16;
  else if (code == "b1") h.dtype = DType::b8;
  else if (code == "i4") h.dtype = DType::i32;
  else if (code == "i8") h.dtype = DType::i64;
  else fail(name, "unsupported dtype '" + descr + "' (expected f2, f4, f8, b1, i4 or i8)");
  const bool native_le = std::endian::native == std::endian::little;
  if (endian == '>') h.swap = native_le && dtype_size(h.dtype) > 1;
  else if (endian == '<' || endian == '|' || endian == '=') h.swap = !native_le && dtype_size(h.dtype) > 1;
  else fail(name, "unsupported byte order in dtype '" + descr + "'");

  try {
    h.numel = checked_numel(h.shape, dtype_size(h.dtype), name);
  } catch (const Error&) {
    fail(name, "the element count of shape " + shape_str(h.shape) + " overflows");
  }
  const std::uint64_t need = static_cast<std::uint64_t>(h.numel) * dtype_size(h.dtype);
  if (need > file_size - h.data_offset)
    fail(name, "truncated data: shape " + shape_str(h.shape) + " of " + std::string(dtype_name(h.dtype)) +
               " needs " + std::to_string(need) + " bytes, file has " + std::to_string(file_size - h.data_offset));
  return h;
}

void byteswap(void* data, std::int64_t n, std::size_t es) {
  auto* p = static_cast<unsigned char*>(data);
  for (std::int64_t i = 0; i < n; ++i, p += es) std::reverse(p, p + es);
}

std::shared_ptr<void> alloc_owned(std::size_t bytes) {
  void* p = std::aligned_alloc(64, std::max<std::size_t>(64, (bytes + 63) / 64 * 64));
  if (!p) throw std::bad_alloc();
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

// Copies raw file data into an owned C-order buffer, fixing byte order and Fortran order.
void fill_owned(const Header& h, const std::byte* src, std::shared_ptr<void>& owner, void*& data) {
  const std::size_t es = dtype_size(h.dtype);
  const std::size_t bytes = static_cast<std::size_t>(h.numel) * es;
  owner = alloc_owned(bytes);
  data = owner.get();
  if (bytes) std::memcpy(data, src, bytes);
  if (h.swap) byteswap(data, h.numel, es);
  if (h.fortran && h.shape.size() > 1 && h.numel > 0) {
    Shape rev(h.shape.rbegin(), h.shape.rend());
    Shape fstrides = contiguous_strides(rev);
    std::reverse(fstrides.begin(), fstrides.end());
    Tensor c = to_contiguous(TensorView(data, h.dtype, h.shape, fstrides), h.dtype);
    std::memcpy(data, c.data(), bytes);
  }
}

}  // namespace

std::int64_t NpyArray::numel() const noexcept {
  std::int64_t n = 1;
  for (auto d : shape_) n *= d;
  return n;
}

NpyArray parse_npy(std::span<const std::byte> bytes, const std::string& name) {
  const Header h = parse_header(bytes.data(), bytes.size(), bytes.size(), name);
  NpyArray a;
  a.dtype_ = h.dtype;
  a.shape_ = h.shape;
  fill_owned(h, bytes.data() + h.data_offset, a.owner_, a.data_);
  return a;
}

NpyArray read_npy(const std::filesystem::path& path) {
  const std::string name = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(name + ": cannot open: " + std::strerror(errno));
  struct Closer { int fd; ~Closer() { ::close(fd); } } closer{fd};
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) throw Error(name + ": not a regular file");
  const auto file_size = static_cast<std::uint64_t>(st.st_size);

  std::vector<std::byte> head(std::min<std::uint64_t>(file_size, 12 + kMaxHeaderLen));
  std::size_t got = 0;
  while (got < head.size()) {
    const ssize_t r = ::pread(fd, head.data() + got, head.size() - got, static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw Error(name + ": read error: " + std::strerror(errno));
    got += static_cast<std::size_t>(r);
  }
  const Header h = parse_header(head.data(), head.size(), file_size, name);

  NpyArray a;
  a.dtype_ = h.dtype;
  a.shape_ = h.shape;
  const std::size_t es = dtype_size(h.dtype);
  const std::size_t bytes = static_cast<std::size_t>(h.numel) * es;
  const bool direct = !h.swap && (!h.fortran || h.shape.size() <= 1) && h.data_offset % es == 0;
  if (direct && bytes > 0) {
    void* m = ::mmap(nullptr, file_size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (m != MAP_FAILED) {
      a.owner_ = std::shared_ptr<void>(m, [file_size](void* p) { ::munmap(p, file_size); });
      a.data_ = static_cast<std::byte*>(m) + h.data_offset;
      a.mapped_ = true;
      return a;
    }
  }
  std::vector<std::byte> raw(bytes);
  got = 0;
  while (got < bytes) {
    const ssize_t r = ::pread(fd, raw.data() + got, bytes - got, static_cast<off_t>(h.data_offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw Error(name + ": read error: " + std::strerror(errno));
    got += static_cast<std::size_t>(r);
  }
  fill_owned(h, raw.data(), a.owner_, a.data_);
  return a;
}

Tensor to_contiguous(const TensorView& t, DType to) {
  Tensor out(to, t.shape());
  const std::int64_t n = out.numel();
  if (n == 0) return out;
  const int r = t.rank();
  std::vector<std::int64_t> idx(static_cast<std::size_t>(r), 0);
  const std::size_t es = dtype_size(t.dtype());
  const bool same = to == t.dtype();
  for (std::int64_t flat = 0; flat < n; ++flat) {
    std::int64_t off = 0;
    for (int a = 0; a < r; ++a) off += idx[static_cast<std::size_t>(a)] * t.stride(a);
    if (same)
      std::memcpy(static_cast<char*>(out.data()) + flat * static_cast<std::int64_t>(es),
                  static_cast<const char*>(t.data()) + off * static_cast<std::int64_t>(es), es);
    else
      store_from_double(out.data(), to, flat, load_as_double(t.data(), t.dtype(), off));
    for (int a = r - 1; a >= 0; --a) {
      if (++idx[static_cast<std::size_t>(a)] < t.size(a)) break;
      idx[static_cast<std::size_t>(a)] = 0;
    }
  }
  return out;
}

void write_npy(const std::filesystem::path& path, const TensorView& t) {
  checked_numel(t.shape(), dtype_size(t.dtype()), path.string());
  const char* descr = nullptr;
  switch (t.dtype()) {
    case DType::f32: descr = "<f4"; break;
    case DType::f64: descr = "<f8"; break;
    case DType::f16: descr = "<f2"; break;
    case DType::b8: descr = "|b1"; break;
    case DType::i32: descr = "<i4"; break;
    case DType::i8: descr = "|i1"; break;
    case DType::u8: descr = "|u1"; break;
    case DType::i64: descr = "<i8"; break;
    case DType::bf16: throw Error(path.string() + ": bfloat16 has no .npy dtype; convert to float32 first");
  }
  std::string shape = "(";
  for (std::size_t i = 0; i < t.shape().size(); ++i) shape += std::to_string(t.shape()[i]) + (t.shape().size() == 1 ? "," : i + 1 < t.shape().size() ? ", " : "");
  shape += ")";
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  std::size_t total = 10 + header.size() + 1;
  const std::size_t pad = (64 - total % 64) % 64;
  header.append(pad, ' ');
  header += '\n';
  if (header.size() > 65535) throw Error(path.string() + ": header too long for .npy version 1.0");

  const Tensor c = t.is_contiguous() ? Tensor() : to_contiguous(t, t.dtype());
  const void* src = t.is_contiguous() ? t.data() : c.data();
  const std::size_t bytes = static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype());

  detail::write_file_atomically(path, [&](std::ostream& f) {
    const unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0,
                                   static_cast<unsigned char>(header.size() & 0xff),
                                   static_cast<unsigned char>(header.size() >> 8)};
    f.write(reinterpret_cast<const char*>(pre), 10);
    f.write(header.data(), static_cast<std::streamsize>(header.size()));
    if (bytes) f.write(static_cast<const char*>(src), static_cast<std::streamsize>(bytes));
  });
}

}  // namespace qkv
