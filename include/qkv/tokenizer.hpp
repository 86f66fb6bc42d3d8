#pragma once
/// @file tokenizer.hpp
/// The llama2.c tokenizer: a SentencePiece BPE vocabulary (Kudo & Richardson 2018, "SentencePiece",
/// EMNLP demo, Sec. 3.1: whitespace is part of the pieces, so decoding is lossless; BPE merges:
/// Sennrich et al. 2016, ACL, Sec. 3.2) in llama2.c's tokenizer.bin layout, with encode and decode
/// as llama2.c's run.c (https://github.com/karpathy/llama2.c, MIT licence) produces them.
///
/// File layout (little-endian): int32 max_token_length, then for every piece: float32 merge score,
/// int32 byte length, the bytes (no terminator). The piece count is not stored: the reader takes
/// pieces until the end of the file and, when the caller passes the model's vocab_size, requires
/// exactly that many. Ids 0, 1, 2 are <unk>, BOS and EOS; ids 3..258 must be the byte pieces
/// "<0x00>".."<0xFF>" (byte fallback emits byte + 3). Refused with qkv::Error naming the file:
/// a truncated file, a max_token_length outside [1, 65536], a negative piece length or one beyond
/// max_token_length or the end of the file, fewer than 259 pieces, misplaced byte pieces, a count
/// other than the expected vocab_size.
///
/// Pieces are byte strings; text is UTF-8 bytes (invalid UTF-8 is encoded byte by byte, never
/// refused). Ids are int, in [0, vocab_size).

#include <cstddef>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace qkv {

/// An immutable vocabulary; copies share it.
class Tokenizer {
 public:
  static constexpr int unk_id = 0;
  static constexpr int bos_id = 1;  ///< begin of sequence; llama2.c's generation stops when it is produced
  static constexpr int eos_id = 2;
  static constexpr int byte_offset = 3;  ///< id of piece "<0xHH>" is 0xHH + byte_offset

  Tokenizer() = default;
  int vocab_size() const noexcept;
  int max_token_length() const noexcept;
  /// The bytes of piece `id`. @throws qkv::Error if id is outside [0, vocab_size).
  std::string_view piece(int id) const;
  /// The merge score of piece `id` (higher merges first). @throws qkv::Error as piece().
  float score(int id) const;
  /// The id of the piece equal to `bytes`, or -1. With duplicate pieces, the lowest id.
  int find(std::string_view bytes) const noexcept;

  /// llama2.c's encode: optional BOS; when `text` is non-empty the dummy-prefix piece " " (or its
  /// byte-fallback id if " " is not a piece); then one token per UTF-8 code point that is a piece
  /// (a lead byte with at most 3 continuation bytes), else one byte-fallback token per byte; then,
  /// repeatedly, the adjacent pair whose concatenation is the piece with the highest score (above
  /// -1e10; the leftmost pair on ties) is replaced by that piece, until no pair merges; optional EOS.
  /// Cost O(n log n) for n bytes of text (llama2.c rescans all pairs per merge: O(n^2)).
  /// @throws qkv::Error on a default-constructed Tokenizer.
  std::vector<int> encode(std::string_view text, bool bos = true, bool eos = false) const;

  /// The text of `token` following `prev_token`, as llama2.c's decode: after BOS a leading space
  /// is stripped; a byte piece "<0xHH>" becomes the single raw byte 0xHH. The view stays valid
  /// while this vocabulary lives. @throws qkv::Error if `token` is outside [0, vocab_size).
  std::string_view decode(int prev_token, int token) const;

  /// Concatenates decode(tokens[i-1], tokens[i]) over the sequence (the first with no previous
  /// token), leaving out BOS and EOS, which carry no text. decode(encode(s)) gives s back whenever
  /// " " is a piece and no merge of the text's pieces spells a byte piece "<0xHH>" (true of the
  /// llama2.c vocabularies).
  /// @throws qkv::Error if a token is outside [0, vocab_size).
  std::string decode(std::span<const int> tokens) const;

 private:
  struct Data;
  friend Tokenizer parse_tokenizer(std::span<const std::byte>, const std::string&, int);
  const Data& data() const;
  std::shared_ptr<const Data> data_;
};

/// Parses tokenizer.bin bytes held in memory. `vocab_size` > 0 requires exactly that many pieces
/// (the model's vocab_size); 0 accepts any count. `name` is used in messages.
/// @throws qkv::Error on malformed input (see the file comment).
Tokenizer parse_tokenizer(std::span<const std::byte> bytes, const std::string& name = "<memory>",
                          int vocab_size = 0);

/// Reads a tokenizer.bin file. @throws qkv::Error on a missing or unreadable file, or as
/// parse_tokenizer.
Tokenizer read_tokenizer(const std::filesystem::path& path, int vocab_size = 0);

/// What may be printed of a decoded piece: the piece itself, or an empty view when it is a single
/// byte that is an ASCII control character other than whitespace (llama2.c's safe_printf skips
/// those). Unlike safe_printf, single bytes >= 0x80 pass, so that a character spelled out by
/// byte-fallback tokens reassembles into UTF-8 on the terminal.
std::string_view printable_piece(std::string_view piece) noexcept;

}  // namespace qkv
