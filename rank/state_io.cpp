#include "rank/state_io.hpp"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "model/trainer.hpp"
#include "runtime/checkpoint_store.hpp"
#include "runtime/communicator.hpp"

namespace dtactor {

namespace {

std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "float32";
    case c10::kDouble: return "float64";
    case c10::kHalf: return "float16";
    case c10::kBFloat16: return "bfloat16";
    case c10::kLong: return "int64";
    case c10::kInt: return "int32";
    case c10::kShort: return "int16";
    case c10::kChar: return "int8";
    case c10::kByte: return "uint8";
    case c10::kBool: return "bool";
    default: return std::string("unsupported:") + c10::toString(t);
  }
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

char* bytes_of(const torch::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// Index of the first entry whose range ends after `at`.
size_t entry_at(const state_layout& l, uint64_t at) {
  auto it = std::upper_bound(l.entries.begin(), l.entries.end(), at,
                             [](uint64_t v, const state_layout::entry& e) { return v < e.offset + e.size; });
  return static_cast<size_t>(it - l.entries.begin());
}

}  // namespace

state_layout layout_of(training_state& state) {
  state_layout l;
  for (auto& [name, t] : state.state_tensors()) {
    const uint64_t size = static_cast<uint64_t>(t.numel()) * t.element_size();
    l.entries.push_back({name, t, l.bytes, size});
    l.bytes += size;
  }
  return l;
}

void describe_layout(const state_layout& layout, pb::checkpoint_meta& meta) {
  meta.clear_tensors();
  for (const auto& e : layout.entries) {
    auto* t = meta.add_tensors();
    t->set_name(e.name);
    t->set_dtype(dtype_name(e.t.scalar_type()));
    for (int64_t d : e.t.sizes()) t->add_shape(d);
    t->set_offset(e.offset);
    t->set_size(e.size);
  }
  meta.set_state_bytes(layout.bytes);
}

void copy_range(const state_layout& layout, uint64_t begin, uint64_t end, char* dst) {
  for (size_t i = entry_at(layout, begin); i < layout.entries.size() && layout.entries[i].offset < end; ++i) {
    const auto& e = layout.entries[i];
    const uint64_t a = std::max(begin, e.offset), b = std::min(end, e.offset + e.size);
    if (a < b) std::memcpy(dst + (a - begin), bytes_of(e.t) + (a - e.offset), b - a);
  }
}

status check_fits(const state_layout& layout, const pb::checkpoint_meta& meta) {
  const std::string lead = "checkpoint does not fit this model: ";
  if (static_cast<size_t>(meta.tensors_size()) != layout.entries.size() || meta.state_bytes() != layout.bytes) {
    // Name the first difference.
    for (const auto& e : layout.entries) {
      bool found = false;
      for (const auto& t : meta.tensors()) found = found || t.name() == e.name;
      if (!found) return make_error(lead + "it has no tensor '" + e.name + "'");
    }
    for (const auto& t : meta.tensors()) {
      bool found = false;
      for (const auto& e : layout.entries) found = found || t.name() == e.name;
      if (!found) return make_error(lead + "its tensor '" + t.name() + "' is not in this model");
    }
  }
  for (size_t i = 0; i < layout.entries.size() && i < static_cast<size_t>(meta.tensors_size()); ++i) {
    const auto& e = layout.entries[i];
    const auto& t = meta.tensors(static_cast<int>(i));
    if (t.name() != e.name) return make_error(lead + "tensor " + std::to_string(i) + " is '" + t.name() + "' in the checkpoint, '" + e.name + "' here");
    const std::vector<int64_t> here(e.t.sizes().begin(), e.t.sizes().end()), there(t.shape().begin(), t.shape().end());
    if (t.dtype() != dtype_name(e.t.scalar_type()) || here != there) {
      return make_error(lead + "tensor '" + e.name + "' is " + t.dtype() + shape_text(there) + " in the checkpoint, " +
                        dtype_name(e.t.scalar_type()) + shape_text(here) + " here");
    }
    if (t.offset() != e.offset) return make_error(lead + "tensor '" + e.name + "' is at another offset");
  }
  if (meta.state_bytes() != layout.bytes)
    return make_error(lead + "its state is " + std::to_string(meta.state_bytes()) + " bytes, this model's " + std::to_string(layout.bytes));
  return {};
}

status load_checkpoint(training_state& state, checkpoint_store& store, const pb::checkpoint_meta& meta) {
  const state_layout layout = layout_of(state);
  if (auto st = check_fits(layout, meta); !st) return st;
  torch::NoGradGuard no_grad;
  bool touched = false;
  auto st = store.read_stream(meta, [&](uint64_t at, const char* data, size_t n) -> status {
    touched = true;
    const uint64_t end = at + n;
    for (size_t i = entry_at(layout, at); i < layout.entries.size() && layout.entries[i].offset < end; ++i) {
      const auto& e = layout.entries[i];
      const uint64_t a = std::max(at, e.offset), b = std::min(end, e.offset + e.size);
      if (a < b) std::memcpy(bytes_of(e.t) + (a - e.offset), data + (a - at), b - a);
    }
    return {};
  });
  if (!st) {
    if (touched) (void)state.reset_state();
    return st;
  }
  state.state_loaded(meta.step());
  return {};
}

result<transfer_stats> broadcast_state(c10d::ProcessGroup& pg, int root, training_state& state, std::chrono::milliseconds timeout,
                                       const std::function<bool()>& abandon, int64_t& tag, uint64_t chunk_bytes) {
  const auto t0 = std::chrono::steady_clock::now();
  auto deadline = [&] { return std::chrono::steady_clock::now() + timeout; };
  c10d::BroadcastOptions bo;
  bo.rootRank = root;
  const bool receiving = pg.getRank() != root;
  const state_layout layout = layout_of(state);
  // Root's step and stream length first: a receiver whose layout differs
  // fails here, before anything lands.
  std::vector<torch::Tensor> head{torch::tensor({state.step(), static_cast<int64_t>(layout.bytes), tag}, torch::kInt64)};
  if (auto st = wait_work(pg.broadcast(head, bo), deadline(), abandon, "state transfer (header)"); !st) return st.err();
  const int64_t step = head[0][0].item<int64_t>();
  tag = head[0][2].item<int64_t>();
  if (static_cast<uint64_t>(head[0][1].item<int64_t>()) != layout.bytes)
    return make_error("state transfer: rank " + std::to_string(root) + " holds " + std::to_string(head[0][1].item<int64_t>()) +
                      " bytes of state, this rank " + std::to_string(layout.bytes) + " (another model?)");
  torch::NoGradGuard no_grad;
  transfer_stats stats;
  // Runs of entries adjacent in memory travel as one byte range.
  size_t i = 0;
  while (i < layout.entries.size()) {
    char* base = bytes_of(layout.entries[i].t);
    uint64_t run = layout.entries[i].size;
    size_t j = i + 1;
    while (j < layout.entries.size() && bytes_of(layout.entries[j].t) == base + run) run += layout.entries[j++].size;
    for (uint64_t at = 0; at < run; at += chunk_bytes) {
      const int64_t n = static_cast<int64_t>(std::min<uint64_t>(chunk_bytes, run - at));
      std::vector<torch::Tensor> t{torch::from_blob(base + at, {n}, torch::kUInt8)};
      if (auto st = wait_work(pg.broadcast(t, bo), deadline(), abandon, "state transfer"); !st) {
        if (receiving) (void)state.reset_state();
        return st.err();
      }
      stats.bytes += static_cast<uint64_t>(n);
    }
    i = j;
  }
  if (receiving) state.state_loaded(step);
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

}  // namespace dtactor
