// Tests of the llama2.c tokenizer reader and its SentencePiece-style BPE encode/decode.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "byte_buffer.hpp"
#include "qkv/error.hpp"
#include "qkv/tokenizer.hpp"

namespace fs = std::filesystem;
using qkv::Tokenizer;
using qkv::test::ByteBuffer;
using qkv::test::file_bytes;
using qkv::test::TempDir;

namespace {

const fs::path kTok = fs::path(QKV_SOURCE_DIR) / "models/stories260K/tok512.bin";

struct Piece {
  float score;
  std::string bytes;
};

// Serialises a vocabulary in tokenizer.bin layout.
std::vector<std::byte> tokenizer_bytes(std::int32_t max_len, const std::vector<Piece>& pieces) {
  ByteBuffer out;
  out.i32(max_len);
  for (const auto& p : pieces) {
    out.f32(p.score);
    out.i32(static_cast<std::int32_t>(p.bytes.size()));
    out.str(p.bytes);
  }
  return out.bytes;
}

// <unk>, <s>, </s> and the 256 byte pieces every llama2.c vocabulary starts with.
std::vector<Piece> base_pieces() {
  std::vector<Piece> v{{0, "<unk>"}, {0, "\n<s>\n"}, {0, "\n</s>\n"}};
  for (int b = 0; b < 256; ++b) {
    char s[8];
    std::snprintf(s, sizeof s, "<0x%02X>", b);
    v.push_back({0, s});
  }
  return v;
}

// llama2.c's encode transcribed literally (full rescan after every merge, lookup in a map), as an
// independent check of the incremental implementation.
std::vector<int> naive_encode(const Tokenizer& t, const std::string& text, bool bos, bool eos) {
  std::map<std::string, int> lookup;
  for (int i = t.vocab_size() - 1; i >= 0; --i) lookup[std::string(t.piece(i))] = i;
  const auto find = [&](const std::string& s) {
    auto it = lookup.find(s);
    return it == lookup.end() ? -1 : it->second;
  };
  std::vector<int> tok;
  if (bos) tok.push_back(1);
  if (!text.empty()) tok.push_back(find(" ") >= 0 ? find(" ") : ' ' + 3);
  std::string buf;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if ((text[i] & 0xC0) != 0x80) buf.clear();
    buf += text[i];
    if (i + 1 < text.size() && (text[i + 1] & 0xC0) == 0x80 && buf.size() < 4) continue;
    const int id = find(buf);
    if (id != -1) {
      tok.push_back(id);
    } else {
      for (unsigned char c : buf) tok.push_back(c + 3);
    }
    buf.clear();
  }
  while (true) {
    float best_score = -1e10f;
    int best_id = -1, best_idx = -1;
    for (int i = 0; i + 1 < static_cast<int>(tok.size()); ++i) {
      const int id = find(std::string(t.piece(tok[i])) + std::string(t.piece(tok[i + 1])));
      if (id != -1 && t.score(id) > best_score) {
        best_score = t.score(id);
        best_id = id;
        best_idx = i;
      }
    }
    if (best_idx == -1) break;
    tok[best_idx] = best_id;
    tok.erase(tok.begin() + best_idx + 1);
  }
  if (eos) tok.push_back(2);
  return tok;
}

// Expects parse_tokenizer to throw a qkv::Error whose message names the input and contains `what`.
void expect_refused(const std::vector<std::byte>& b, const std::string& what, int vocab_size = 0) {
  try {
    (void)qkv::parse_tokenizer(b, "hostile.bin", vocab_size);
    ADD_FAILURE() << "accepted; expected an error containing '" << what << "'";
  } catch (const qkv::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("hostile.bin"), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  }
}

}  // namespace

TEST(Tokenizer, ReadsTheStories260KVocabulary) {
  const Tokenizer t = qkv::read_tokenizer(kTok, 512);
  EXPECT_EQ(t.vocab_size(), 512);
  EXPECT_EQ(t.max_token_length(), 7);
  EXPECT_EQ(t.piece(0), "<unk>");
  EXPECT_EQ(t.piece(Tokenizer::bos_id), "\n<s>\n");
  EXPECT_EQ(t.piece(Tokenizer::eos_id), "\n</s>\n");
  EXPECT_EQ(t.piece(3), "<0x00>");
  EXPECT_EQ(t.piece(258), "<0xFF>");
  EXPECT_EQ(t.piece(403), " Once");
  EXPECT_EQ(t.score(403), -144.0f);
  EXPECT_EQ(t.find(" Once"), 403);
  EXPECT_EQ(t.find(" "), 410);
  EXPECT_EQ(t.find("\xC3\xA9"), 485);  // é is a piece of this vocabulary
  EXPECT_EQ(t.find("no such piece"), -1);
  EXPECT_EQ(t.find(""), -1);
  for (int i = 0; i < t.vocab_size(); ++i) EXPECT_EQ(t.find(t.piece(i)), i) << i;
}

TEST(Tokenizer, OnceUponATimeEncodesAsLlama2c) {
  const Tokenizer t = qkv::read_tokenizer(kTok);
  // BOS, " Once", " upon", " a", " time": the dummy-prefix space merges into each word's first piece.
  const std::vector<int> want{1, 403, 407, 261, 378};
  const auto ids = t.encode("Once upon a time");
  EXPECT_EQ(ids, want);
  EXPECT_EQ(ids, naive_encode(t, "Once upon a time", true, false));
  EXPECT_EQ(t.decode(ids), "Once upon a time");
  EXPECT_EQ(t.decode(1, 403), "Once");  // the space after BOS is stripped
  EXPECT_EQ(t.decode(403, 407), " upon");
  EXPECT_EQ(t.decode(407, 403), " Once");

  std::vector<int> with_eos = want;
  with_eos.push_back(2);
  EXPECT_EQ(t.encode("Once upon a time", true, true), with_eos);
  EXPECT_EQ(t.encode("Once upon a time", false, false), std::vector<int>(want.begin() + 1, want.end()));
  EXPECT_EQ(t.decode(t.encode("Once upon a time", false, false)), " Once upon a time");
  EXPECT_EQ(t.decode(with_eos), "Once upon a time");
}

TEST(Tokenizer, EmptyText) {
  const Tokenizer t = qkv::read_tokenizer(kTok);
  EXPECT_EQ(t.encode(""), std::vector<int>{1});
  EXPECT_EQ(t.encode("", false, false), std::vector<int>{});
  EXPECT_EQ(t.encode("", true, true), (std::vector<int>{1, 2}));
  EXPECT_EQ(t.decode(std::vector<int>{1}), "");
  EXPECT_EQ(t.decode(std::vector<int>{}), "");
  // A single space: the dummy prefix and the space, which do not merge ("  " is not a piece).
  EXPECT_EQ(t.encode(" "), (std::vector<int>{1, 410, 410}));
  EXPECT_EQ(t.decode(t.encode(" ")), " ");
}

TEST(Tokenizer, ByteFallbackForCharactersNotInTheVocabulary) {
  const Tokenizer t = qkv::read_tokenizer(kTok);
  // U+1F600 is F0 9F 98 80: four byte tokens, id = byte + 3.
  const std::string emoji = "\xF0\x9F\x98\x80";
  EXPECT_EQ(t.encode(emoji), (std::vector<int>{1, 410, 0xF0 + 3, 0x9F + 3, 0x98 + 3, 0x80 + 3}));
  EXPECT_EQ(t.decode(t.encode(emoji)), emoji);
  EXPECT_EQ(t.decode(410, 0xF0 + 3), "\xF0");
  // ü (C3 BC) is not a piece, é (C3 A9) is.
  EXPECT_EQ(t.encode("\xC3\xBC"), (std::vector<int>{1, 410, 0xC3 + 3, 0xBC + 3}));
  EXPECT_EQ(t.encode("\xC3\xA9"), (std::vector<int>{1, 410, 485}));
  EXPECT_EQ(t.decode(t.encode("caf\xC3\xA9 \xC3\xBC")), "caf\xC3\xA9 \xC3\xBC");
  // Control characters and NUL are not pieces either.
  const std::string ctrl("a\0b\x01", 4);
  const auto ids = t.encode(ctrl);
  EXPECT_EQ(ids, naive_encode(t, ctrl, true, false));
  EXPECT_NE(std::find(ids.begin(), ids.end(), 3), ids.end());  // <0x00>
  EXPECT_EQ(t.decode(ids), ctrl);
}

TEST(Tokenizer, InvalidUtf8IsEncodedBytewise) {
  const Tokenizer t = qkv::read_tokenizer(kTok);
  for (const std::string s : {std::string("\x80\x80"
                                          "abc"),
                              std::string("x\xC3"), std::string("\xC3\xA9\xA9\xA9\xA9\xA9 y"),
                              std::string("\xFF\xFE"), std::string("\xE2\x80")}) {
    const auto ids = t.encode(s);
    EXPECT_EQ(ids, naive_encode(t, s, true, false)) << s;
    EXPECT_EQ(t.decode(ids), s);
  }
}

TEST(Tokenizer, MatchesTheLiteralAlgorithmOnRandomText) {
  const Tokenizer t = qkv::read_tokenizer(kTok);
  const std::vector<std::string> atoms{
      "a",  "e",  "t",      "h",    "o",   "n",   " ",        " ",        "  ",           ".",
      ",",  "!",  "Lily",   " the", "Tim", "my",  "\xC3\xA9", "\xC3\xBC", "\xE2\x80\x9C", "\xF0\x9F\x98\x80",
      "\n", "\t", "<0x41>", "1",    "Z",   "\x80"};
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 300; ++trial) {
    std::string s;
    const int n = static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) s += atoms[rng() % atoms.size()];
    const bool bos = rng() % 4 != 0, eos = rng() % 2 == 0;
    const auto ids = t.encode(s, bos, eos);
    ASSERT_EQ(ids, naive_encode(t, s, bos, eos)) << "text: " << s;
    for (int id : ids) ASSERT_TRUE(id >= 0 && id < t.vocab_size());
    // Without BOS the dummy-prefix space stays in the text, as in SentencePiece.
    EXPECT_EQ(t.decode(ids), bos || s.empty() ? s : " " + s);
  }
}

TEST(Tokenizer, MatchesTheLiteralAlgorithmWithManyTiedScores) {
  // A vocabulary over a 4-letter alphabet whose pieces share a handful of scores, so that the
  // leftmost-on-ties rule decides most merges.
  std::mt19937 rng(99);
  for (int vocab_trial = 0; vocab_trial < 20; ++vocab_trial) {
    auto v = base_pieces();
    v.push_back({0, " "});
    const std::string alphabet = "ab c";
    std::vector<std::string> frontier{"a", "b", "c", " "};
    for (const auto& f : frontier) v.push_back({-1, f});
    for (int k = 0; k < 60; ++k) {
      std::string p = frontier[rng() % frontier.size()] + frontier[rng() % frontier.size()];
      if (p.size() > 6) continue;
      frontier.push_back(p);
      v.push_back({static_cast<float>(rng() % 3), p});
    }
    const Tokenizer t = qkv::parse_tokenizer(tokenizer_bytes(6, v));
    for (int trial = 0; trial < 30; ++trial) {
      std::string s;
      const int n = static_cast<int>(rng() % 60);
      for (int i = 0; i < n; ++i) s += alphabet[rng() % alphabet.size()];
      ASSERT_EQ(t.encode(s), naive_encode(t, s, true, false)) << "text: '" << s << "'";
      EXPECT_EQ(t.decode(t.encode(s)), s);
    }
  }
}

TEST(Tokenizer, LongTextStaysFastAndRoundTrips) {
  const Tokenizer t = qkv::read_tokenizer(kTok);
  std::string s;
  while (s.size() < 200000)
    s += "Once upon a time, there was a little girl named Lily. She loved to play outside. ";
  const auto ids = t.encode(s);
  EXPECT_LT(ids.size(), s.size() / 3);
  EXPECT_EQ(t.decode(ids), s);
  const std::string head = s.substr(0, 2000);
  EXPECT_EQ(t.encode(head), naive_encode(t, head, true, false));
}

TEST(Tokenizer, MergesByBestScoreLeftmostOnTiesAndNotAtOrBelowTheThreshold) {
  auto v = base_pieces();
  v.push_back({-1, " "});
  for (const char* s : {"a", "b", "c"}) v.push_back({-1, s});
  v.push_back({1.0f, "ab"});    // 263
  v.push_back({1.0f, "bc"});    // 264
  v.push_back({-2e10f, "ca"});  // 265: scored below llama2.c's -1e10 floor, never merged
  v.push_back({5.0f, "abc"});   // 266
  v.push_back({9.0f, "bb"});    // 267
  const Tokenizer t = qkv::parse_tokenizer(tokenizer_bytes(6, v));
  EXPECT_EQ(t.encode("abc"), (std::vector<int>{1, 259, 266}));  // ab (leftmost tie), then abc
  EXPECT_EQ(t.encode("ca"), (std::vector<int>{1, 259, 262, 260}));
  EXPECT_EQ(t.encode("abbc"), (std::vector<int>{1, 259, 260, 267, 262}));  // bb (9) beats ab and bc
  for (const std::string s : {"abc", "ca", "abbc", "cabcab", "bcbcbca"})
    EXPECT_EQ(t.encode(s), naive_encode(t, s, true, false)) << s;
}

TEST(Tokenizer, DummyPrefixFallsBackToTheSpaceByteWhenSpaceIsNotAPiece) {
  auto v = base_pieces();
  v.push_back({0, "a"});
  const Tokenizer t = qkv::parse_tokenizer(tokenizer_bytes(6, v));
  EXPECT_EQ(t.encode("a"), (std::vector<int>{1, ' ' + 3, 259}));
  EXPECT_EQ(t.encode(" a"), (std::vector<int>{1, ' ' + 3, ' ' + 3, 259}));
}

TEST(Tokenizer, DecodeMapsBytePiecesAndRangeChecks) {
  const Tokenizer t = qkv::read_tokenizer(kTok);
  for (int b = 0; b < 256; ++b) {
    const auto s = t.decode(0, b + 3);
    ASSERT_EQ(s.size(), 1u);
    EXPECT_EQ(static_cast<unsigned char>(s[0]), b);
  }
  EXPECT_EQ(t.decode(1, 3 + ' '), " ");  // a byte piece keeps its space after BOS
  EXPECT_THROW((void)t.decode(1, 512), qkv::Error);
  EXPECT_THROW((void)t.decode(1, -1), qkv::Error);
  EXPECT_THROW((void)t.piece(512), qkv::Error);
  EXPECT_THROW((void)t.score(-1), qkv::Error);
  EXPECT_THROW((void)t.decode(std::vector<int>{1, 5, 9999}), qkv::Error);
  const Tokenizer empty;
  EXPECT_EQ(empty.vocab_size(), 0);
  EXPECT_EQ(empty.find("a"), -1);
  EXPECT_THROW((void)empty.encode("a"), qkv::Error);
}

TEST(Tokenizer, PrintablePieceSkipsLoneControlBytes) {
  EXPECT_EQ(qkv::printable_piece("\x01"), "");
  EXPECT_EQ(qkv::printable_piece(std::string_view("\0", 1)), "");
  EXPECT_EQ(qkv::printable_piece("\x1b"), "");
  EXPECT_EQ(qkv::printable_piece("\x7f"), "");
  EXPECT_EQ(qkv::printable_piece("\n"), "\n");
  EXPECT_EQ(qkv::printable_piece("\t"), "\t");
  EXPECT_EQ(qkv::printable_piece(" "), " ");
  EXPECT_EQ(qkv::printable_piece("a"), "a");
  EXPECT_EQ(qkv::printable_piece("\xF0"), "\xF0");  // part of a UTF-8 character
  EXPECT_EQ(qkv::printable_piece(" Once"), " Once");
  EXPECT_EQ(qkv::printable_piece(""), "");
}

TEST(Tokenizer, CopiesShareTheVocabulary) {
  Tokenizer copy;
  {
    const Tokenizer t = qkv::read_tokenizer(kTok);
    copy = t;
  }
  EXPECT_EQ(copy.encode("Once upon a time"), (std::vector<int>{1, 403, 407, 261, 378}));
}

TEST(TokenizerHostile, EveryTruncationIsRefusedWhenTheVocabSizeIsKnown) {
  const auto good = file_bytes(kTok);
  ASSERT_EQ(good.size(), 6227u);
  for (std::size_t n = 0; n < good.size(); ++n) {
    const std::vector<std::byte> cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW((void)qkv::parse_tokenizer(cut, "cut.bin", 512), qkv::Error) << n;
  }
}

TEST(TokenizerHostile, TruncationWithoutAVocabSizeGivesAPrefixOrAnError) {
  const auto good = file_bytes(kTok);
  const Tokenizer full = qkv::parse_tokenizer(good);
  int accepted = 0;
  for (std::size_t n = 0; n < good.size(); ++n) {
    const std::vector<std::byte> cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
    try {
      const Tokenizer t = qkv::parse_tokenizer(cut, "cut.bin");
      ++accepted;  // cut on a piece boundary: a shorter, still well-formed vocabulary
      ASSERT_GE(t.vocab_size(), 259);
      ASSERT_LT(t.vocab_size(), 512);
      for (int i = 0; i < t.vocab_size(); ++i) ASSERT_EQ(t.piece(i), full.piece(i));
    } catch (const qkv::Error& e) {
      ASSERT_NE(std::string(e.what()).find("cut.bin"), std::string::npos);
    }
  }
  EXPECT_EQ(accepted, 512 - 259);  // boundaries after pieces 259..511
}

TEST(TokenizerHostile, MalformedFieldsAreRefused) {
  const auto v = base_pieces();
  EXPECT_NO_THROW((void)qkv::parse_tokenizer(tokenizer_bytes(6, v)));
  expect_refused({}, "shorter than the 4-byte");
  expect_refused(tokenizer_bytes(0, v), "max_token_length");
  expect_refused(tokenizer_bytes(-5, v), "max_token_length");
  expect_refused(tokenizer_bytes(1 << 20, v), "max_token_length");
  expect_refused(tokenizer_bytes(5, v), "more than max_token_length");  // "<0x00>" is 6 bytes
  expect_refused(tokenizer_bytes(6, {v.begin(), v.begin() + 10}), "fewer than the 259");
  expect_refused(tokenizer_bytes(6, v), "vocab_size is 512", 512);

  auto swapped = v;
  std::swap(swapped[3], swapped[4]);
  expect_refused(tokenizer_bytes(6, swapped), "byte piece <0x00>");

  // A length field pointing past the end of the file, or negative.
  auto b = tokenizer_bytes(6, v);
  const std::size_t last_len = b.size() - 6 - 4;  // the last piece "<0xFF>": its length field
  std::int32_t huge = 0x7fffffff;
  std::memcpy(b.data() + last_len, &huge, 4);
  expect_refused(b, "more than max_token_length");
  auto b2 = tokenizer_bytes(1 << 16, v);
  std::int32_t beyond = 7;
  std::memcpy(b2.data() + last_len, &beyond, 4);
  expect_refused(b2, "declares 7 bytes, the file has 6 left");
  std::int32_t neg = -1;
  std::memcpy(b2.data() + last_len, &neg, 4);
  expect_refused(b2, "negative length");
  b2.resize(b2.size() - 10);  // cut inside the last piece's score/length pair
  expect_refused(b2, "needs 8 bytes");
  EXPECT_THROW((void)qkv::parse_tokenizer(tokenizer_bytes(6, v), "x", -1), qkv::Error);
}

TEST(TokenizerHostile, FilesOnDiskAreCheckedAndNamed) {
  const TempDir dir("tokenizer");
  auto bytes = file_bytes(kTok);
  bytes.resize(1000);
  const fs::path p = dir.write("truncated.bin", bytes);
  try {
    (void)qkv::read_tokenizer(p);
    ADD_FAILURE() << "accepted a truncated tokenizer";
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)qkv::read_tokenizer(dir.path() / "missing.bin"), qkv::Error);
  EXPECT_THROW((void)qkv::read_tokenizer(dir.path()), qkv::Error);  // a directory
  EXPECT_THROW((void)qkv::read_tokenizer(dir.write("empty.bin", {})), qkv::Error);
}

TEST(TokenizerHostile, RandomCorruptionNeverEscapesAsAnythingButQkvError) {
  const auto good = file_bytes(kTok);
  std::mt19937 rng(77);
  for (int trial = 0; trial < 2000; ++trial) {
    auto b = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) b[rng() % b.size()] = static_cast<std::byte>(rng() & 0xff);
    if (rng() % 3 == 0) b.resize(rng() % b.size());
    try {
      const Tokenizer t = qkv::parse_tokenizer(b, "corrupt.bin");
      const auto ids = t.encode("Once upon a time, \xC3\xA9\xF0\x9F\x98\x80!");
      for (int id : ids) ASSERT_TRUE(id >= 0 && id < t.vocab_size());
      (void)t.decode(ids);
    } catch (const qkv::Error&) {
    }
  }
}
