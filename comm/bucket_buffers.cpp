#include "comm/bucket_buffers.hpp"

namespace dtactor {

namespace {
// Only the handle here points at the buffer: no view, no collective's input.
bool unshared(const torch::Tensor& t) { return t.use_count() == 1 && t.storage().use_count() == 1; }
}  // namespace

void bucket_buffers::give(torch::Tensor t) {
  if (!t.defined()) return;
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(std::move(t));
}

torch::Tensor bucket_buffers::take(int64_t n, const torch::TensorOptions& o) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it)
    if (it->numel() == n && it->scalar_type() == o.dtype().toScalarType() && it->device() == o.device() && unshared(*it)) {
      torch::Tensor t = std::move(*it);
      free_.erase(it);
      return t;
    }
  return {};
}

void bucket_buffers::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  free_.clear();
}

int64_t bucket_buffers::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& t : free_) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}

}  // namespace dtactor

namespace dtactor {

int64_t bucket_buffers::takeable_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& t : free_)
    if (unshared(t)) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}

}  // namespace dtactor
