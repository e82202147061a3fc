#pragma once
// Non-cryptographic 64-bit hashing (XXH3 from libxxhash) for checksums and
// digests: checkpoint payloads, parameter digests, config digests.
#include <cstddef>
#include <cstdint>
#include <string>

namespace dtactor {

uint64_t hash64(const void* data, size_t size, uint64_t seed = 0);

// Streaming form, for data that arrives in pieces (e.g. many tensors).
class hasher {
 public:
  hasher();
  ~hasher();
  hasher(const hasher&) = delete;
  hasher& operator=(const hasher&) = delete;
  void update(const void* data, size_t size);
  uint64_t digest() const;

 private:
  void* state_;
};

std::string hex64(uint64_t v);

}  // namespace dtactor
