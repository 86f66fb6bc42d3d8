// llama2.c tokenizer.bin reader and SentencePiece-style BPE encode/decode (see tokenizer.hpp).
#include "qkv/tokenizer.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <climits>
#include <cstdint>
#include <cstdio>

#include "io/little_endian.hpp"
#include "io/mapped_file.hpp"
#include "qkv/error.hpp"

namespace qkv {

struct Tokenizer::Data {
  int max_token_length = 0;
  std::string blob;                  // all pieces, back to back
  std::vector<std::size_t> offsets;  // piece i is blob[offsets[i], offsets[i + 1])
  std::vector<float> scores;
  std::vector<int> sorted;  // ids ordered by (piece bytes, id), for binary search

  int size() const noexcept { return static_cast<int>(scores.size()); }
  std::string_view piece(int id) const noexcept {
    const auto i = static_cast<std::size_t>(id);
    return std::string_view(blob).substr(offsets[i], offsets[i + 1] - offsets[i]);
  }
};

namespace {

using detail::load_u32;

constexpr int kMaxTokenLength = 1 << 16;
constexpr int kBytePieces = 256;

// The 256 single-byte strings that byte pieces decode to.
constexpr std::array<char, 256> kBytes = [] {
  std::array<char, 256> a{};
  for (int i = 0; i < 256; ++i) a[static_cast<std::size_t>(i)] = static_cast<char>(i);
  return a;
}();

[[noreturn]] void fail(const std::string& name, const std::string& what) {
  throw Error(name + ": not a valid llama2.c tokenizer: " + what);
}

std::string byte_piece(int b) {
  char s[8];
  std::snprintf(s, sizeof s, "<0x%02X>", static_cast<unsigned>(b));
  return s;
}

int hex_digit(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// The byte a piece "<0xHH>" stands for, or -1.
int byte_of_piece(std::string_view p) noexcept {
  if (p.size() != 6 || p.substr(0, 3) != "<0x" || p[5] != '>') return -1;
  const int hi = hex_digit(p[3]), lo = hex_digit(p[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

}  // namespace

const Tokenizer::Data& Tokenizer::data() const {
  if (!data_) throw Error("tokenizer: empty (default-constructed); read or parse a tokenizer.bin first");
  return *data_;
}

int Tokenizer::vocab_size() const noexcept { return data_ ? data_->size() : 0; }
int Tokenizer::max_token_length() const noexcept { return data_ ? data_->max_token_length : 0; }

std::string_view Tokenizer::piece(int id) const {
  const Data& d = data();
  if (id < 0 || id >= d.size())
    throw Error("token: expected an id in [0, " + std::to_string(d.size()) + "), got " + std::to_string(id));
  return d.piece(id);
}

float Tokenizer::score(int id) const {
  piece(id);  // range check
  return data_->scores[static_cast<std::size_t>(id)];
}

int Tokenizer::find(std::string_view bytes) const noexcept {
  if (!data_) return -1;
  const Data& d = *data_;
  const auto it = std::lower_bound(d.sorted.begin(), d.sorted.end(), bytes,
                                   [&d](int id, std::string_view key) { return d.piece(id) < key; });
  return it != d.sorted.end() && d.piece(*it) == bytes ? *it : -1;
}

std::vector<int> Tokenizer::encode(std::string_view text, bool bos, bool eos) const {
  const Data& d = data();
  std::vector<int> tok;
  tok.reserve(text.size() + 3);
  if (bos) tok.push_back(bos_id);
  if (!text.empty()) {
    // SentencePiece's add_dummy_prefix: the text is encoded as if it began with a space.
    const int space = find(" ");
    tok.push_back(space >= 0 ? space : ' ' + byte_offset);
  }

  // One token per code point (a lead byte plus at most 3 continuation bytes, as llama2.c groups
  // them), or byte-fallback tokens when the code point is not a piece.
  std::string cp;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if ((c & 0xC0) != 0x80) cp.clear();
    cp.push_back(static_cast<char>(c));
    const bool next_continues =
        i + 1 < text.size() && (static_cast<unsigned char>(text[i + 1]) & 0xC0) == 0x80;
    if (next_continues && cp.size() < 4) continue;
    const int id = find(cp);
    if (id >= 0) {
      tok.push_back(id);
    } else {
      for (const char b : cp) tok.push_back(static_cast<unsigned char>(b) + byte_offset);
    }
    cp.clear();
  }

  // Merge. llama2.c rescans every adjacent pair after each merge (O(n^2) lookups); the same
  // choice - the highest score above -1e10, the leftmost pair on ties - comes from a max-heap of
  // candidate pairs over a linked list of tokens, with entries made stale by a merge skipped when
  // popped: O(n log n). A merged token keeps its left part's index, so index order is text order.
  const std::size_t n = tok.size();
  std::vector<std::size_t> next(n), prev(n);
  std::vector<std::uint32_t> version(n, 0);  // bumped when a token changes or is merged away
  for (std::size_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i - 1;  // wraps for i == 0; never read there
  }
  struct Candidate {
    float score;
    std::size_t left, right;
    int id;
    std::uint32_t left_version, right_version;
  };
  const auto worse = [](const Candidate& a, const Candidate& b) {
    return a.score != b.score ? a.score < b.score : a.left > b.left;
  };
  std::vector<Candidate> heap;
  std::string buf;
  const auto consider = [&](std::size_t i, std::size_t j) {
    buf.assign(d.piece(tok[i]));
    buf.append(d.piece(tok[j]));
    const int id = find(buf);
    if (id < 0) return;
    const float sc = d.scores[static_cast<std::size_t>(id)];
    if (!(sc > -1e10f)) return;  // llama2.c's floor; also keeps NaN out of the ordering
    heap.push_back({sc, i, j, id, version[i], version[j]});
    std::push_heap(heap.begin(), heap.end(), worse);
  };
  for (std::size_t i = 0; i + 1 < n; ++i) consider(i, i + 1);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    const Candidate c = heap.back();
    heap.pop_back();
    if (version[c.left] != c.left_version || version[c.right] != c.right_version) continue;
    tok[c.left] = c.id;
    ++version[c.left];
    ++version[c.right];
    tok[c.right] = -1;
    next[c.left] = next[c.right];
    if (next[c.left] < n) prev[next[c.left]] = c.left;
    // Token 0 is never a right part, so it stays; every other live token has a live prev.
    if (c.left > 0) consider(prev[c.left], c.left);
    if (next[c.left] < n) consider(c.left, next[c.left]);
  }
  tok.erase(std::remove(tok.begin(), tok.end(), -1), tok.end());
  if (eos) tok.push_back(eos_id);
  return tok;
}

std::string_view Tokenizer::decode(int prev_token, int token) const {
  std::string_view p = piece(token);
  // SentencePiece drops the dummy-prefix space of the first piece after BOS.
  if (prev_token == bos_id && !p.empty() && p[0] == ' ') p.remove_prefix(1);
  const int b = byte_of_piece(p);
  if (b >= 0) return std::string_view(&kBytes[static_cast<std::size_t>(b)], 1);
  return p;
}

std::string Tokenizer::decode(std::span<const int> tokens) const {
  std::string out;
  int prev = -1;
  for (const int t : tokens) {
    const std::string_view s = decode(prev, t);  // range-checks t
    if (t != bos_id && t != eos_id) out += s;
    prev = t;
  }
  return out;
}

Tokenizer parse_tokenizer(std::span<const std::byte> bytes, const std::string& name, int vocab_size) {
  if (vocab_size < 0)
    throw Error(name + ": vocab_size: expected >= 0 (0 = any), got " + std::to_string(vocab_size));
  const std::size_t size = bytes.size();
  const std::byte* b = bytes.data();
  if (size < 4)
    fail(name, "file is " + std::to_string(size) + " bytes, shorter than the 4-byte max_token_length");
  const auto mtl = static_cast<std::int32_t>(load_u32(b));
  if (mtl < 1 || mtl > kMaxTokenLength)
    fail(name, "max_token_length must be in [1, " + std::to_string(kMaxTokenLength) + "], got " +
                   std::to_string(mtl));

  auto d = std::make_shared<Tokenizer::Data>();
  d->max_token_length = mtl;
  d->blob.reserve(size);
  d->offsets.push_back(0);
  std::size_t pos = 4;
  while (pos < size) {
    const std::size_t i = d->scores.size();
    if (i == static_cast<std::size_t>(INT_MAX)) fail(name, "more than INT_MAX pieces");
    if (size - pos < 8)
      fail(name, "truncated: piece " + std::to_string(i) + " at offset " + std::to_string(pos) +
                     " needs 8 bytes for its score and length, the file has " + std::to_string(size - pos) +
                     " left");
    const float score = std::bit_cast<float>(load_u32(b + pos));
    const auto len = static_cast<std::int32_t>(load_u32(b + pos + 4));
    pos += 8;
    if (len < 0) fail(name, "piece " + std::to_string(i) + " has a negative length " + std::to_string(len));
    if (len > mtl)
      fail(name, "piece " + std::to_string(i) + " has length " + std::to_string(len) +
                     ", more than max_token_length " + std::to_string(mtl));
    if (static_cast<std::size_t>(len) > size - pos)
      fail(name, "truncated: piece " + std::to_string(i) + " declares " + std::to_string(len) +
                     " bytes, the file has " + std::to_string(size - pos) + " left");
    d->blob.append(reinterpret_cast<const char*>(b + pos), static_cast<std::size_t>(len));
    d->offsets.push_back(d->blob.size());
    d->scores.push_back(score);
    pos += static_cast<std::size_t>(len);
  }
  const int n = d->size();
  if (vocab_size > 0 && n != vocab_size)
    fail(name,
         "holds " + std::to_string(n) + " pieces, the model's vocab_size is " + std::to_string(vocab_size));
  if (n < Tokenizer::byte_offset + kBytePieces)
    fail(name, "holds " + std::to_string(n) + " pieces, fewer than the " +
                   std::to_string(Tokenizer::byte_offset + kBytePieces) +
                   " of <unk>, BOS, EOS and the 256 byte pieces");
  for (int v = 0; v < kBytePieces; ++v) {
    const std::string want = byte_piece(v);
    if (d->piece(v + Tokenizer::byte_offset) != want)
      fail(name, "piece " + std::to_string(v + Tokenizer::byte_offset) + " must be the byte piece " + want);
  }
  d->sorted.resize(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) d->sorted[static_cast<std::size_t>(i)] = i;
  const Tokenizer::Data& cd = *d;
  std::sort(d->sorted.begin(), d->sorted.end(), [&cd](int a, int c) {
    const auto pa = cd.piece(a), pc = cd.piece(c);
    return pa != pc ? pa < pc : a < c;
  });
  Tokenizer t;
  t.data_ = std::move(d);
  return t;
}

Tokenizer read_tokenizer(const std::filesystem::path& path, int vocab_size) {
  const detail::MappedFile file(path);
  return parse_tokenizer(file.bytes(), path.string(), vocab_size);
}

std::string_view printable_piece(std::string_view piece) noexcept {
  if (piece.size() == 1) {
    const auto c = static_cast<unsigned char>(piece[0]);
    const bool space = c == ' ' || (c >= '\t' && c <= '\r');
    if ((c < 0x20 && !space) || c == 0x7F) return {};
  }
  return piece;
}

}  // namespace qkv
