// llama2.c checkpoint reader (versions 0, 1 and 2; layouts in include/qkv/llama2c.hpp).
// The header is validated and the file length checked against the config before anything is
// allocated; the weights are then copied (or dequantised) in file order into one aligned buffer.
#include "qkv/llama2c.hpp"

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "io/little_endian.hpp"
#include "io/mapped_file.hpp"
#include "qkv/error.hpp"

namespace qkv {
namespace {

using detail::load_f32;
using detail::load_i32;
using detail::load_u32;

constexpr std::uint32_t kMagic = 0x616b3432;  // "ak42" read as a little-endian uint32
constexpr std::size_t kLegacyHeader = 28;     // 7 int32
constexpr std::size_t kHeader = 256;          // versions 1 and 2
constexpr std::int64_t kMaxField = std::int64_t{1} << 24;
constexpr std::uint64_t kAlign = 16;  // floats: each tensor starts on a 64-byte boundary

[[noreturn]] void fail(const std::string& name, const std::string& what) {
  throw Error(name + ": not a valid llama2.c checkpoint: " + what);
}

// Size arithmetic in uint64 that refuses to wrap.
struct Sizes {
  const std::string& name;
  std::uint64_t mul(std::uint64_t a, std::uint64_t b) const {
    std::uint64_t r = 0;
    if (__builtin_mul_overflow(a, b, &r)) fail(name, "the sizes implied by the config overflow 64 bits");
    return r;
  }
  std::uint64_t add(std::uint64_t a, std::uint64_t b) const {
    std::uint64_t r = 0;
    if (__builtin_add_overflow(a, b, &r)) fail(name, "the sizes implied by the config overflow 64 bits");
    return r;
  }
};

// Element counts of every tensor the file holds, derived from a validated config.
struct Counts {
  std::uint64_t emb, dim, wq, wkv, w13, rope, cls;
  std::uint64_t layers;
};

Counts counts_of(const Llama2cConfig& c, const Sizes& s) {
  Counts n{};
  const auto u = [](int v) { return static_cast<std::uint64_t>(v); };
  n.layers = u(c.n_layers);
  n.emb = s.mul(u(c.vocab_size), u(c.dim));
  n.dim = u(c.dim);
  n.wq = s.mul(u(c.dim), u(c.dim));
  n.wkv = s.mul(u(c.kv_dim), u(c.dim));
  n.w13 = s.mul(u(c.hidden_dim), u(c.dim));
  n.rope = s.mul(u(c.max_seq_len), u(c.head_dim));  // cos and sin, head_dim/2 each
  n.cls = c.shared_classifier ? 0 : n.emb;
  return n;
}

// Bytes that the weights after the header occupy in the file.
std::uint64_t payload_bytes(const Llama2cConfig& c, const Counts& n, const Sizes& s) {
  // Per layer: rms_att, rms_ffn (dim each), wq, wo (dim*dim), wk, wv (kv_dim*dim), w1, w2, w3.
  const std::uint64_t norms = s.add(s.mul(n.layers, 2 * n.dim), n.dim);
  if (c.version == 2) {
    const std::uint64_t g = static_cast<std::uint64_t>(c.group_size);
    const auto q = [&](std::uint64_t numel) { return s.add(numel, s.mul(numel / g, 4)); };
    std::uint64_t per_layer = s.add(s.mul(2, q(n.wq)), s.mul(2, q(n.wkv)));
    per_layer = s.add(per_layer, s.mul(3, q(n.w13)));
    std::uint64_t total = s.add(s.mul(norms, 4), q(n.emb));
    total = s.add(total, s.mul(n.layers, per_layer));
    return s.add(total, n.cls ? q(n.cls) : 0);
  }
  std::uint64_t per_layer = s.add(s.mul(2, n.wq), s.mul(2, n.wkv));
  per_layer = s.add(per_layer, s.mul(3, n.w13));
  std::uint64_t floats = s.add(s.add(norms, n.emb), s.mul(n.layers, per_layer));
  if (c.version == 0) floats = s.add(floats, n.rope);
  floats = s.add(floats, n.cls);
  return s.mul(floats, 4);
}

void check_field(const std::string& name, const char* field, std::int64_t v) {
  if (v <= 0) fail(name, std::string(field) + " must be positive, got " + std::to_string(v));
  if (v > kMaxField)
    fail(name,
         std::string(field) + " = " + std::to_string(v) + " exceeds the limit " + std::to_string(kMaxField));
}

// Reads sequentially through the weights; bounds were checked against the file length already,
// the checks here only make a bug impossible to turn into an out-of-bounds read.
class Cursor {
 public:
  Cursor(std::span<const std::byte> bytes, std::size_t offset, const std::string& name)
      : bytes_(bytes), pos_(offset), name_(name) {}
  void f32(float* dst, std::uint64_t n) {
    const std::byte* p = take(n * 4);
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(dst, p, n * 4);
    } else {
      for (std::uint64_t i = 0; i < n; ++i) dst[i] = load_f32(p + 4 * i);
    }
  }
  // Q8_0: n int8 values, then n / group float32 scales; w = float(q) * scale (as runq.c).
  void q80(float* dst, std::uint64_t n, std::uint64_t group) {
    const std::byte* q = take(n);
    const std::byte* sc = take(n / group * 4);
    for (std::uint64_t g = 0; g < n / group; ++g) {
      const float scale = load_f32(sc + 4 * g);
      for (std::uint64_t i = g * group; i < (g + 1) * group; ++i)
        dst[i] = static_cast<float>(static_cast<std::int8_t>(static_cast<std::uint8_t>(q[i]))) * scale;
    }
  }
  void skip(std::uint64_t bytes) { take(bytes); }
  std::size_t pos() const noexcept { return pos_; }

 private:
  const std::byte* take(std::uint64_t n) {
    if (n > bytes_.size() - pos_) fail(name_, "internal size mismatch while reading the weights");
    const std::byte* p = bytes_.data() + pos_;
    pos_ += static_cast<std::size_t>(n);
    return p;
  }
  std::span<const std::byte> bytes_;
  std::size_t pos_;
  const std::string& name_;
};

}  // namespace

Llama2cConfig parse_llama2c_config(std::span<const std::byte> bytes, const std::string& name) {
  const std::size_t size = bytes.size();
  const std::byte* b = bytes.data();
  if (size < 4) fail(name, "file is " + std::to_string(size) + " bytes, too short for a header");
  Llama2cConfig c;
  std::size_t header = kLegacyHeader;
  const std::byte* fields = b;
  std::int64_t vocab = 0;
  if (load_u32(b) == kMagic) {
    if (size < 8) fail(name, "file is " + std::to_string(size) + " bytes, truncated inside the header");
    const std::int32_t version = load_i32(b + 4);
    if (version != 1 && version != 2)
      fail(name,
           "unsupported version " + std::to_string(version) + " after the magic \"ak42\" (expected 1 or 2)");
    c.version = version;
    header = kHeader;
    if (size < header)
      fail(name, "file is " + std::to_string(size) + " bytes, shorter than the 256-byte version-" +
                     std::to_string(version) + " header");
    fields = b + 8;
    vocab = load_i32(fields + 20);
    const auto shared = static_cast<unsigned>(b[36]);
    if (shared > 1) fail(name, "shared_classifier byte must be 0 or 1, got " + std::to_string(shared));
    c.shared_classifier = shared == 1;
    if (vocab <= 0) fail(name, "vocab_size must be positive, got " + std::to_string(vocab));
  } else {
    c.version = 0;
    if (size < kLegacyHeader)
      fail(name, "file is " + std::to_string(size) + " bytes, shorter than the 28-byte version-0 header");
    vocab = load_i32(fields + 20);
    // The legacy format's sign convention: negative means wcls is stored after the RoPE tables.
    c.shared_classifier = vocab > 0;
    if (vocab < 0) vocab = -vocab;  // int64: -INT32_MIN does not overflow
  }
  const std::int64_t dim = load_i32(fields), hidden = load_i32(fields + 4), layers = load_i32(fields + 8),
                     heads = load_i32(fields + 12), kv_heads = load_i32(fields + 16),
                     seq = load_i32(fields + 24);
  check_field(name, "dim", dim);
  check_field(name, "hidden_dim", hidden);
  check_field(name, "n_layers", layers);
  check_field(name, "n_heads", heads);
  check_field(name, "n_kv_heads", kv_heads);
  check_field(name, "vocab_size", vocab);
  check_field(name, "max_seq_len", seq);
  if (dim % heads != 0)
    fail(name,
         "dim (" + std::to_string(dim) + ") is not a multiple of n_heads (" + std::to_string(heads) + ")");
  if (heads % kv_heads != 0)
    fail(name, "n_heads (" + std::to_string(heads) + ") is not a multiple of n_kv_heads (" +
                   std::to_string(kv_heads) + ")");
  if ((dim / heads) % 2 != 0)
    fail(name, "head_dim = dim / n_heads = " + std::to_string(dim / heads) + " is odd (RoPE rotates pairs)");
  c.dim = static_cast<int>(dim);
  c.hidden_dim = static_cast<int>(hidden);
  c.n_layers = static_cast<int>(layers);
  c.n_heads = static_cast<int>(heads);
  c.n_kv_heads = static_cast<int>(kv_heads);
  c.vocab_size = static_cast<int>(vocab);
  c.max_seq_len = static_cast<int>(seq);
  c.head_dim = c.dim / c.n_heads;
  c.kv_dim = c.n_kv_heads * c.head_dim;

  const Sizes s{name};
  const Counts n = counts_of(c, s);
  if (c.version == 2) {
    const std::int32_t g = load_i32(b + 37);
    if (g <= 0) fail(name, "group_size must be positive, got " + std::to_string(g));
    c.group_size = g;
    const auto gs = static_cast<std::uint64_t>(g);
    const struct {
      const char* what;
      std::uint64_t numel;
    } mats[] = {{"token_embedding [vocab_size, dim]", n.emb},
                {"wq/wo [dim, dim]", n.wq},
                {"wk/wv [kv_dim, dim]", n.wkv},
                {"w1/w2/w3 [hidden_dim, dim]", n.w13}};
    for (const auto& m : mats)
      if (m.numel % gs != 0)
        fail(name, std::string("group_size ") + std::to_string(g) + " does not divide the " +
                       std::to_string(m.numel) + " values of " + m.what);
  }
  const std::uint64_t need = s.add(header, payload_bytes(c, n, s));
  if (need != size)
    fail(name, "the config (dim " + std::to_string(c.dim) + ", hidden_dim " + std::to_string(c.hidden_dim) +
                   ", n_layers " + std::to_string(c.n_layers) + ", n_heads " + std::to_string(c.n_heads) +
                   ", n_kv_heads " + std::to_string(c.n_kv_heads) + ", vocab_size " +
                   std::to_string(c.vocab_size) + ", max_seq_len " + std::to_string(c.max_seq_len) +
                   (c.shared_classifier ? ", shared classifier" : ", separate classifier") +
                   (c.version == 2 ? ", group_size " + std::to_string(c.group_size) : std::string()) +
                   ") implies a version-" + std::to_string(c.version) + " file of " + std::to_string(need) +
                   " bytes, got " + std::to_string(size) +
                   (need > size ? " (truncated?)" : " (trailing data?)"));
  return c;
}

Llama2cModel parse_llama2c(std::span<const std::byte> bytes, const std::string& name) {
  const Llama2cConfig c = parse_llama2c_config(bytes, name);
  const Sizes s{name};
  const Counts n = counts_of(c, s);

  // Plan the aligned storage: every tensor starts on a multiple of kAlign floats. The total is
  // bounded by a small multiple of the (already checked) file length.
  std::uint64_t total = 0;
  const auto slot = [&](std::uint64_t numel) {
    const std::uint64_t off = total;
    total = s.add(total, s.mul((numel + kAlign - 1) / kAlign, kAlign));
    return off;
  };
  struct LayerOff {
    std::uint64_t rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3;
  };
  const std::uint64_t emb_off = slot(n.emb);
  std::vector<LayerOff> lo(n.layers);
  for (auto& l : lo) {
    l.rms_att = slot(n.dim);
    l.wq = slot(n.wq);
    l.wk = slot(n.wkv);
    l.wv = slot(n.wkv);
    l.wo = slot(n.wq);
    l.rms_ffn = slot(n.dim);
    l.w1 = slot(n.w13);
    l.w2 = slot(n.w13);
    l.w3 = slot(n.w13);
  }
  const std::uint64_t final_off = slot(n.dim);
  const std::uint64_t cls_off = c.shared_classifier ? emb_off : slot(n.cls);

  auto storage = std::make_shared<Tensor>(DType::f32, Shape{static_cast<std::int64_t>(total)});
  float* base = static_cast<float*>(storage->data());
  const auto at = [base](std::uint64_t off) { return base + off; };

  Cursor cur(bytes, c.version == 0 ? kLegacyHeader : kHeader, name);
  if (c.version == 0) {
    cur.f32(at(emb_off), n.emb);
    for (auto& l : lo) cur.f32(at(l.rms_att), n.dim);
    for (auto& l : lo) cur.f32(at(l.wq), n.wq);
    for (auto& l : lo) cur.f32(at(l.wk), n.wkv);
    for (auto& l : lo) cur.f32(at(l.wv), n.wkv);
    for (auto& l : lo) cur.f32(at(l.wo), n.wq);
    for (auto& l : lo) cur.f32(at(l.rms_ffn), n.dim);
    for (auto& l : lo) cur.f32(at(l.w1), n.w13);
    for (auto& l : lo) cur.f32(at(l.w2), n.w13);
    for (auto& l : lo) cur.f32(at(l.w3), n.w13);
    cur.f32(at(final_off), n.dim);
    cur.skip(s.mul(n.rope, 4));
    if (!c.shared_classifier) cur.f32(at(cls_off), n.cls);
  } else {
    for (auto& l : lo) cur.f32(at(l.rms_att), n.dim);
    for (auto& l : lo) cur.f32(at(l.rms_ffn), n.dim);
    cur.f32(at(final_off), n.dim);
    const auto g = static_cast<std::uint64_t>(c.group_size);
    const auto mat = [&](std::uint64_t off, std::uint64_t numel) {
      if (c.version == 2)
        cur.q80(at(off), numel, g);
      else
        cur.f32(at(off), numel);
    };
    mat(emb_off, n.emb);
    for (auto& l : lo) mat(l.wq, n.wq);
    for (auto& l : lo) mat(l.wk, n.wkv);
    for (auto& l : lo) mat(l.wv, n.wkv);
    for (auto& l : lo) mat(l.wo, n.wq);
    for (auto& l : lo) mat(l.w1, n.w13);
    for (auto& l : lo) mat(l.w2, n.w13);
    for (auto& l : lo) mat(l.w3, n.w13);
    if (!c.shared_classifier) mat(cls_off, n.cls);
  }
  if (cur.pos() != bytes.size()) fail(name, "internal size mismatch after reading the weights");

  const std::int64_t d = c.dim, h = c.hidden_dim, kv = c.kv_dim, v = c.vocab_size;
  const auto view = [&](std::uint64_t off, Shape shape) {
    return TensorView(at(off), DType::f32, std::move(shape));
  };
  Llama2cModel m;
  m.config = c;
  m.token_embedding = view(emb_off, {v, d});
  m.layers.reserve(lo.size());
  for (const auto& l : lo) {
    m.layers.push_back(Llama2cLayer{view(l.rms_att, {d}), view(l.wq, {d, d}), view(l.wk, {kv, d}),
                                    view(l.wv, {kv, d}), view(l.wo, {d, d}), view(l.rms_ffn, {d}),
                                    view(l.w1, {h, d}), view(l.w2, {d, h}), view(l.w3, {h, d})});
  }
  m.rms_final = view(final_off, {d});
  m.wcls = view(cls_off, {v, d});
  m.storage = std::move(storage);
  return m;
}

Llama2cModel read_llama2c(const std::filesystem::path& path) {
  const detail::MappedFile file(path);
  return parse_llama2c(file.bytes(), path.string());
}

}  // namespace qkv
