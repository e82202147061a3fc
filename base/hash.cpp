#include "base/hash.hpp"

#include <xxhash.h>

#include <cstdio>
#include <new>

namespace dtactor {

uint64_t hash64(const void* data, size_t size, uint64_t seed) { return XXH3_64bits_withSeed(data, size, seed); }

hasher::hasher() : state_(XXH3_createState()) {
  if (!state_) throw std::bad_alloc();
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}

hasher::~hasher() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

void hasher::update(const void* data, size_t size) { XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, size); }

uint64_t hasher::digest() const { return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_)); }

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace dtactor
