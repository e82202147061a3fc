// nanoGPT's .bin token streams (data/npy.hpp token_file): flat uint16 ids,
// memory-mapped and checked against the vocabulary when opened. Properties:
// open never crashes; every id of an accepted file is below the vocabulary
// and every window the sampler can take lies inside the file.
#include <algorithm>
#include <vector>

#include "fuzz/fuzz_util.hpp"
#include "data/npy.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  // The first bytes choose the vocabulary and the window, as a config would.
  const uint32_t vocab = 1u + (static_cast<uint32_t>(data[0]) << 8 | data[1]);
  const uint64_t context = 1 + data[2] % 64;
  fuzz::memory_file file(std::string_view(reinterpret_cast<const char*>(data + 3), size - 3));
  auto t = token_file::open(file.path(), vocab, context + 1);
  if (!t) return 0;
  if (t->size() * 2 != size - 3 || t->size() < context + 1) fuzz::fail("an accepted token file of the wrong size");
  std::vector<int64_t> window;
  for (uint64_t start = 0; start + context + 1 <= t->size() && start < 4096; start += context) {
    t->window(start, context + 1, window);
    for (int64_t id : window)
      if (id < 0 || static_cast<uint64_t>(id) >= vocab) fuzz::fail("a token id outside the vocabulary");
  }
  return 0;
}
