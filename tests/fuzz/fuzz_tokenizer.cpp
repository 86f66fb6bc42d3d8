// libFuzzer target: the llama2.c tokenizer, both its reader and its encoder/decoder.
// The first input byte picks the mode:
//   even: the rest is a tokenizer.bin to parse; if accepted, a fixed text is encoded and decoded
//         and every id must lie in [0, vocab_size).
//   odd:  the rest is a text encoded with the real tok512 vocabulary of stories260K; decoding the
//         ids must give the text back byte for byte (the lossless round trip the header promises).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>

#include "qkv/error.hpp"
#include "qkv/tokenizer.hpp"

namespace {
const qkv::Tokenizer& real_vocab() {
  static const qkv::Tokenizer t = [] {
    const char* env = std::getenv("QKV_FUZZ_TOKENIZER");
    return qkv::read_tokenizer(env ? env : QKV_SOURCE_DIR "/models/stories260K/tok512.bin", 512);
  }();
  return t;
}

void check_ids(const qkv::Tokenizer& t, const std::vector<int>& ids) {
  for (int id : ids)
    if (id < 0 || id >= t.vocab_size()) __builtin_trap();
}
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)real_vocab();  // fail early (qkv::Error escapes) if the vocabulary is missing
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::span<const std::byte> rest(reinterpret_cast<const std::byte*>(data) + 1, size - 1);
  if ((data[0] & 1) == 0) {
    try {
      const qkv::Tokenizer t = qkv::parse_tokenizer(rest, "fuzz-tokenizer.bin");
      const std::vector<int> ids = t.encode("Once upon a time, \xe2\x9c\x93 <0x41> \xff", true, true);
      check_ids(t, ids);
      (void)t.decode(ids);
      for (int id = 0; id < t.vocab_size() && id < 300; ++id) (void)t.decode(1, id);
    } catch (const qkv::Error&) {
    }
    return 0;
  }
  const qkv::Tokenizer& t = real_vocab();
  const std::string_view text(reinterpret_cast<const char*>(rest.data()), rest.size());
  const std::vector<int> ids = t.encode(text, true, false);
  check_ids(t, ids);
  if (t.decode(ids) != text) __builtin_trap();
  return 0;
}
