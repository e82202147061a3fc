#include "storage/checkpoint_plan.hpp"

#include <algorithm>
#include <cstring>

#include "base/ranges.hpp"

namespace dtactor {

byte_range part_range(uint64_t n, int rank, int world) {
  if (world <= 1) return {0, n};
  constexpr uint64_t align = 4096;
  const uint64_t w = static_cast<uint64_t>(world);
  const uint64_t share = ((n + w - 1) / w + align - 1) / align * align;
  const uint64_t a = std::min<uint64_t>(n, share * static_cast<uint64_t>(rank));
  const uint64_t b = rank == world - 1 ? n : std::min<uint64_t>(n, a + share);
  return {a, b};
}

namespace {

// "workers/<r>/..." -> r; -1 for any other name.
int worker_of(const std::string& name) {
  const size_t p = std::strlen(worker_section_prefix);
  if (name.compare(0, p, worker_section_prefix) != 0) return -1;
  int64_t r = 0;
  size_t i = p;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9' && r <= (int64_t{1} << 30); ++i) r = r * 10 + (name[i] - '0');
  return i > p && i < name.size() && name[i] == '/' && r <= (int64_t{1} << 30) ? static_cast<int>(r) : -1;
}

// A sharded tensor's bytes over index-space ranges.
void add_windows(std::vector<byte_range>& out, const stream_tensor& t, const std::vector<index_range>& ranges) {
  if (t.element_bytes == 0) return;
  const int64_t n = static_cast<int64_t>(t.size / t.element_bytes);
  for (const auto& [a, b] : ranges) {
    const int64_t lo = std::max<int64_t>(a - t.index_base, 0), hi = std::min<int64_t>(b - t.index_base, n);
    if (lo < hi) out.emplace_back(t.offset + static_cast<uint64_t>(lo) * t.element_bytes, t.offset + static_cast<uint64_t>(hi) * t.element_bytes);
  }
}

// Balanced: its part_range of the bytes held whole (as if those tensors
// were back to back), mapped onto the stream, and the windows of its
// primary shards.
std::vector<byte_range> owned_balanced(const std::vector<stream_tensor>& tensors, const rank_share& share) {
  uint64_t whole = 0;
  for (const auto& t : tensors)
    if (!t.sharded) whole += t.size;
  const auto [ra, rb] = part_range(whole, share.rank, share.world);
  std::vector<byte_range> out;
  uint64_t seen = 0;
  for (const auto& t : tensors) {
    if (t.sharded) {
      add_windows(out, t, share.primary);
      continue;
    }
    const uint64_t a = std::max(ra, seen), b = std::min(rb, seen + t.size);
    if (a < b) out.emplace_back(t.offset + (a - seen), t.offset + (b - seen));
    seen += t.size;
  }
  return out;
}

}  // namespace

std::vector<stream_tensor> stream_of(const pb::checkpoint_meta& meta, const std::map<std::string, int64_t>& sharded) {
  std::vector<stream_tensor> out;
  out.reserve(static_cast<size_t>(meta.tensors_size()));
  for (const auto& t : meta.tensors()) {
    stream_tensor s;
    s.name = t.name();
    s.offset = t.offset();
    s.size = t.size();
    uint64_t n = 1;
    for (int64_t d : t.shape()) n *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
    s.element_bytes = n > 0 && t.size() % n == 0 && t.size() > 0 ? t.size() / n : 1;
    if (auto it = sharded.find(t.name()); it != sharded.end()) {
      s.sharded = true;
      s.index_base = it->second;
    }
    s.worker = worker_of(t.name());
    out.push_back(std::move(s));
  }
  std::stable_sort(out.begin(), out.end(), [](const stream_tensor& a, const stream_tensor& b) { return a.offset < b.offset; });
  return out;
}

std::vector<byte_range> rank_ranges(const std::vector<stream_tensor>& tensors, const rank_share& share, stream_scope scope) {
  std::vector<byte_range> out;
  auto whole = [&](const stream_tensor& t) { out.emplace_back(t.offset, t.offset + t.size); };
  if (scope == stream_scope::owned && !share.per_worker) return normalized(owned_balanced(tensors, share));
  for (const auto& t : tensors) {
    const bool proper = t.worker < 0;
    switch (scope) {
      case stream_scope::owned:  // per worker: each holds a whole state of its own
        if (share.rank == 0 ? proper : t.worker == share.rank) whole(t);
        break;
      case stream_scope::whole:
        if (proper && t.sharded) add_windows(out, t, share.held);
        if (proper && !t.sharded) whole(t);
        break;
      case stream_scope::replicated:
        if (proper && !t.sharded) whole(t);
        break;
      case stream_scope::shards:
        if (t.sharded) add_windows(out, t, share.held);
        break;
      case stream_scope::own_section:
        if (!proper && t.worker == share.rank) whole(t);
        break;
    }
  }
  return normalized(std::move(out));
}

std::vector<byte_range> local_save_plan(const std::vector<stream_tensor>& tensors, const rank_share& share) {
  auto out = rank_ranges(tensors, share, stream_scope::owned);
  if (out.empty()) {
    uint64_t end = 0;
    for (const auto& t : tensors) end = std::max(end, t.offset + t.size);
    out.emplace_back(end, end);
  }
  return out;
}

result<load_plan> plan_load(const pb::checkpoint_meta& meta, const std::vector<byte_range>& wanted) {
  const auto needed = normalized(wanted);
  uint64_t need = 0;
  for (const auto& [a, b] : needed) {
    if (b > meta.state_bytes())
      return make_error("bytes [" + std::to_string(a) + ", " + std::to_string(b) + ") are outside the checkpoint's " +
                        std::to_string(meta.state_bytes()) + "-byte state");
    need += b - a;
  }
  load_plan plan;
  size_t k = 0;  // the first needed range that may still overlap a part
  for (int i = 0; i < meta.parts_size(); ++i) {
    const auto& part = meta.parts(i);
    const uint64_t lo = part.offset(), hi = part.offset() + part.size();
    if (lo >= hi) continue;
    while (k < needed.size() && needed[k].second <= lo) ++k;
    load_plan::read r;
    r.part = i;
    for (size_t j = k; j < needed.size() && needed[j].first < hi; ++j) {
      const uint64_t a = std::max(lo, needed[j].first), b = std::min(hi, needed[j].second);
      if (a < b) r.keep.emplace_back(a, b);
      plan.kept_bytes += a < b ? b - a : 0;
    }
    if (r.keep.empty()) continue;
    plan.read_bytes += part.size();
    plan.reads.push_back(std::move(r));
  }
  if (plan.kept_bytes != need)
    return make_error("the checkpoint's parts hold " + std::to_string(plan.kept_bytes) + " of the " + std::to_string(need) +
                      " bytes to load once (they do not tile the stream)");
  return plan;
}

}  // namespace dtactor
