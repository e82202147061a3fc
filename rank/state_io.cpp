#include "rank/state_io.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <sstream>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "model/trainer.hpp"
#include "storage/checkpoint_store.hpp"
#include "comm/communicator.hpp"
#include "comm/shm_group.hpp"

namespace dtactor {

namespace {

std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return "float32";
    case c10::kDouble:
      return "float64";
    case c10::kHalf:
      return "float16";
    case c10::kBFloat16:
      return "bfloat16";
    case c10::kLong:
      return "int64";
    case c10::kInt:
      return "int32";
    case c10::kShort:
      return "int16";
    case c10::kChar:
      return "int8";
    case c10::kByte:
      return "uint8";
    case c10::kBool:
      return "bool";
    default:
      return std::string("unsupported:") + c10::toString(t);
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
  auto it = std::upper_bound(l.entries.begin(), l.entries.end(), at, [](uint64_t v, const state_layout::entry& e) { return v < e.offset + e.size; });
  return static_cast<size_t>(it - l.entries.begin());
}

}  // namespace

bool state_layout::sharded() const {
  for (const auto& t : tensors)
    if (t.sharded) return true;
  return false;
}

uint64_t state_layout::replicated_bytes() const {
  uint64_t n = 0;
  for (const auto& t : tensors)
    if (!t.sharded) n += t.size;
  return n;
}

state_layout layout_of(training_state& state) {
  state_layout l;
  for (auto& st : state.state_tensors()) {
    const uint64_t esize = static_cast<uint64_t>(st.t.element_size());
    if (l.tensors.empty() || l.tensors.back().name != st.name) {
      state_layout::tensor t;
      t.name = st.name;
      t.dtype = st.t.scalar_type();
      t.shape = st.shape;
      int64_t n = 1;
      for (int64_t d : st.shape) n *= d;
      t.offset = l.bytes;
      t.size = static_cast<uint64_t>(n) * esize;
      t.sharded = st.sharded;
      l.bytes += t.size;
      l.tensors.push_back(std::move(t));
    }
    const auto& t = l.tensors.back();
    const uint64_t size = static_cast<uint64_t>(st.t.numel()) * esize;
    if (size == 0) continue;
    l.entries.push_back({st.name, st.t, t.offset + static_cast<uint64_t>(st.first) * esize, size, st.sharded});
  }
  return l;
}

namespace {
// Each sharded tensor's index base: "optim/exp_avg.<g>" / "optim/exp_avg_sq.<g>"
// start at group g's first element.
std::map<std::string, int64_t> shard_bases(const state_layout& layout, const std::vector<int64_t>& group_bases) {
  std::map<std::string, int64_t> out;
  for (const auto& t : layout.tensors) {
    if (!t.sharded) continue;
    const size_t dot = t.name.rfind('.');
    const size_t g = dot == std::string::npos ? 0 : static_cast<size_t>(std::strtoull(t.name.c_str() + dot + 1, nullptr, 10));
    out[t.name] = g < group_bases.size() ? group_bases[g] : 0;
  }
  return out;
}
}  // namespace

std::map<std::string, int64_t> sharded_params(training_state& state) {
  std::map<std::string, int64_t> out;
  if (!masters_sharded(state.settings().train)) return out;
  for (const auto& kv : state.the_task().module()->named_parameters())
    if (auto r = state.optimizer().range_of(kv.value())) out["model/" + kv.key()] = r->first;
  return out;
}

std::vector<stream_tensor> stream_tensors(const state_layout& layout, const std::vector<int64_t>& group_bases) {
  pb::checkpoint_meta meta;
  describe_layout(layout, meta);
  return stream_of(meta, shard_bases(layout, group_bases));
}

std::vector<byte_range> save_ranges(const state_layout& layout, const rank_share& share, const std::vector<int64_t>& group_bases,
                                    const std::map<std::string, int64_t>& params_sharded) {
  if (params_sharded.empty()) return local_save_plan(stream_tensors(layout, group_bases), share);
  pb::checkpoint_meta meta;
  describe_layout(layout, meta);
  auto bases = shard_bases(layout, group_bases);
  bases.insert(params_sharded.begin(), params_sharded.end());
  return local_save_plan(stream_of(meta, bases), share);
}

namespace {
// Reads the bytes `ranges` of `meta` (through the load planner: the parts
// holding them, each whole, its checksum checked) straight into `mine`'s
// entries, which must hold them all. `touched`: some bytes landed; `read`:
// bytes of the parts read.
status read_into(checkpoint_store& store, const pb::checkpoint_meta& meta, const state_layout& mine, const std::vector<byte_range>& ranges,
                 bool& touched, uint64_t& read) {
  auto plan = plan_load(meta, ranges);
  if (!plan) return plan.err();
  uint64_t landed = 0;
  auto st = store.read_planned(meta, plan.value(), [&](uint64_t at, const char* data, size_t n) -> status {
    const uint64_t end = at + n;
    for (size_t i = entry_at(mine, at); i < mine.entries.size() && mine.entries[i].offset < end; ++i) {
      const auto& e = mine.entries[i];
      const uint64_t a = std::max(at, e.offset), b = std::min(end, e.offset + e.size);
      if (a < b) {
        touched = true;
        landed += b - a;
        std::memcpy(bytes_of(e.t) + (a - e.offset), data + (a - at), b - a);
      }
    }
    return {};
  });
  read = plan->read_bytes;
  if (!st) return st;
  if (landed != plan->kept_bytes)
    return make_error("the load plan names " + std::to_string(plan->kept_bytes) + " bytes of the checkpoint and this rank holds " +
                      std::to_string(landed) + " of them");
  return {};
}
}  // namespace

bool worker_owned(const std::string& name) {
  auto starts = [&](const char* p) { return name.rfind(p, 0) == 0; };
  return starts("model/") || starts("buffer/") || (starts("optim/") && name != "optim/steps");
}

namespace {
std::string section_name(int rank, const std::string& name) { return worker_section_prefix + std::to_string(rank) + "/" + name; }
}  // namespace

bool stable_until_update(const std::string& name) {
  std::string base = name;
  if (base.rfind(worker_section_prefix, 0) == 0) {
    const auto slash = base.find('/', std::char_traits<char>::length(worker_section_prefix));
    base = slash == std::string::npos ? std::string() : base.substr(slash + 1);
  }
  for (const char* p : {"model/", "optim/exp_avg.", "optim/exp_avg_sq.", "outer/global.", "outer/momentum."})
    if (base.rfind(p, 0) == 0) return true;
  return false;
}

state_layout with_worker_sections(state_layout layout, int rank, int world) {
  const size_t n = layout.tensors.size();
  const std::vector<state_layout::entry> main_entries = layout.entries;
  for (int r = 1; r < world; ++r) {
    for (size_t i = 0; i < n; ++i) {
      const state_layout::tensor t = layout.tensors[i];
      if (t.sharded || !worker_owned(t.name)) continue;
      state_layout::tensor s = t;
      s.name = section_name(r, t.name);
      s.offset = layout.bytes;
      layout.bytes += s.size;
      if (r == rank)
        for (const auto& e : main_entries)
          if (e.name == t.name) layout.entries.push_back({s.name, e.t, s.offset + (e.offset - t.offset), e.size, false});
      layout.tensors.push_back(std::move(s));
    }
  }
  return layout;
}

std::pair<uint64_t, uint64_t> section_range(const state_layout& l, int rank) {
  const std::string prefix = section_name(rank, "");
  uint64_t a = 0, b = 0;
  bool any = false;
  for (const auto& t : l.tensors) {
    if (t.name.rfind(prefix, 0) != 0) continue;
    if (!any) a = t.offset;
    any = true;
    b = t.offset + t.size;
  }
  return any ? std::make_pair(a, b) : std::make_pair(l.bytes, l.bytes);
}

uint64_t stream_bytes(const pb::checkpoint_meta& meta) {
  for (const auto& t : meta.tensors())
    if (t.name().rfind(worker_section_prefix, 0) == 0) return t.offset();
  return meta.state_bytes();
}

void describe_layout(const state_layout& layout, pb::checkpoint_meta& meta) {
  meta.clear_tensors();
  for (const auto& e : layout.tensors) {
    auto* t = meta.add_tensors();
    t->set_name(e.name);
    t->set_dtype(dtype_name(e.dtype));
    for (int64_t d : e.shape) t->add_shape(d);
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

status check_fits(const state_layout& layout, const pb::checkpoint_meta& full) {
  const std::string lead = "checkpoint does not fit this model: ";
  // DiLoCo's worker sections follow the stream; they are checked when a
  // rank loads its own (load_worker_section).
  pb::checkpoint_meta meta;
  for (const auto& t : full.tensors())
    if (t.name().rfind(worker_section_prefix, 0) != 0) *meta.add_tensors() = t;
  meta.set_state_bytes(stream_bytes(full));
  if (static_cast<size_t>(meta.tensors_size()) != layout.tensors.size() || meta.state_bytes() != layout.bytes) {
    // Name the first difference.
    for (const auto& e : layout.tensors) {
      bool found = false;
      for (const auto& t : meta.tensors()) found = found || t.name() == e.name;
      if (!found) return make_error(lead + "it has no tensor '" + e.name + "'");
    }
    for (const auto& t : meta.tensors()) {
      bool found = false;
      for (const auto& e : layout.tensors) found = found || t.name() == e.name;
      if (!found) return make_error(lead + "its tensor '" + t.name() + "' is not in this model");
    }
  }
  for (size_t i = 0; i < layout.tensors.size() && i < static_cast<size_t>(meta.tensors_size()); ++i) {
    const auto& e = layout.tensors[i];
    const auto& t = meta.tensors(static_cast<int>(i));
    if (t.name() != e.name)
      return make_error(lead + "tensor " + std::to_string(i) + " is '" + t.name() + "' in the checkpoint, '" + e.name + "' here");
    const std::vector<int64_t>& here = e.shape;
    const std::vector<int64_t> there(t.shape().begin(), t.shape().end());
    if (t.dtype() != dtype_name(e.dtype) || here != there) {
      return make_error(lead + "tensor '" + e.name + "' is " + t.dtype() + shape_text(there) + " in the checkpoint, " + dtype_name(e.dtype) +
                        shape_text(here) + " here");
    }
    if (t.offset() != e.offset) return make_error(lead + "tensor '" + e.name + "' is at another offset");
  }
  if (meta.state_bytes() != layout.bytes)
    return make_error(lead + "its state is " + std::to_string(meta.state_bytes()) + " bytes, this model's " + std::to_string(layout.bytes));
  return {};
}

status load_checkpoint(training_state& state, checkpoint_store& store, const pb::checkpoint_meta& meta, load_which which,
                       uint64_t* bytes_read) {
  const state_layout layout = layout_of(state);
  if (auto st = check_fits(layout, meta); !st) return st;
  torch::NoGradGuard no_grad;
  // This rank's bytes, as the load planner decides them from what it holds
  // (parts holding none of them are not read at all, nor, with DiLoCo's
  // worker sections, the other workers' sections).
  const auto& opt = state.optimizer();
  rank_share share;
  if (layout.sharded()) share.held = opt.held_ranges();
  const stream_scope scope = which == load_which::replicated ? stream_scope::replicated
                             : which == load_which::shards   ? stream_scope::shards
                                                             : stream_scope::whole;
  // train.zero = 3: the parameters are sharded like the moments, so that no
  // rank reads (or, its root, sends) the whole model: each reads its own.
  auto bases = shard_bases(layout, opt.group_bases());
  if (layout.sharded())
    for (const auto& [name, base] : sharded_params(state)) bases[name] = base;
  const auto ranges = rank_ranges(stream_of(meta, bases), share, scope);
  bool touched = false;
  uint64_t read = 0;
  auto st = read_into(store, meta, layout, ranges, touched, read);
  if (bytes_read) *bytes_read = read;
  if (!st) {
    if (touched) (void)state.reset_state();
    return st;
  }
  if (which != load_which::shards) state.state_loaded(meta.step());
  return {};
}

result<bool> load_worker_section(training_state& state, checkpoint_store& store, const pb::checkpoint_meta& meta, int rank) {
  if (rank <= 0) return false;
  const state_layout layout = layout_of(state);
  const std::string prefix = section_name(rank, "");
  state_layout mine;
  for (const auto& t : meta.tensors()) {
    if (t.name().rfind(prefix, 0) != 0) continue;
    const std::string name = t.name().substr(prefix.size());
    const state_layout::tensor* here = nullptr;
    for (const auto& l : layout.tensors)
      if (l.name == name) here = &l;
    const std::vector<int64_t> there(t.shape().begin(), t.shape().end());
    if (!here || !worker_owned(name) || here->sharded || t.dtype() != dtype_name(here->dtype) || here->shape != there || t.size() != here->size)
      return make_error("checkpoint does not fit this model: its worker section tensor '" + t.name() + "' is " + t.dtype() + shape_text(there) +
                        (here ? ", here " + dtype_name(here->dtype) + shape_text(here->shape) : ", not a worker's tensor here"));
    for (const auto& e : layout.entries)
      if (e.name == name) mine.entries.push_back({t.name(), e.t, t.offset() + (e.offset - here->offset), e.size, false});
  }
  if (mine.entries.empty()) return false;
  std::sort(mine.entries.begin(), mine.entries.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  torch::NoGradGuard no_grad;
  rank_share share;
  share.rank = rank;
  bool touched = false;
  uint64_t read = 0;
  auto st = read_into(store, meta, mine, rank_ranges(stream_of(meta), share, stream_scope::own_section), touched, read);
  if (!st) {
    if (touched) (void)state.reset_state();
    return st.err();
  }
  return true;
}

namespace {

// The replicated entries of `layout` but those in `skip`.
std::vector<state_layout::entry> transferred(const state_layout& layout, const std::map<std::string, int64_t>& skip) {
  std::vector<state_layout::entry> entries;
  for (const auto& e : layout.entries)
    if (!e.sharded && !skip.count(e.name)) entries.push_back(e);
  return entries;
}

// Entries as byte chunks of at most `chunk_bytes`: runs of entries adjacent
// in memory travel as one range.
std::vector<std::pair<char*, int64_t>> transfer_chunks(const std::vector<state_layout::entry>& entries, uint64_t chunk_bytes) {
  std::vector<std::pair<char*, int64_t>> out;
  for (size_t i = 0; i < entries.size();) {
    char* base = bytes_of(entries[i].t);
    uint64_t run = entries[i].size;
    size_t j = i + 1;
    while (j < entries.size() && bytes_of(entries[j].t) == base + run) run += entries[j++].size;
    for (uint64_t at = 0; at < run; at += chunk_bytes) out.emplace_back(base + at, static_cast<int64_t>(std::min<uint64_t>(chunk_bytes, run - at)));
    i = j;
  }
  return out;
}

// The chunks through the ring of a shared-memory group (every rank
// reserves the same regions in the same order): root waits until a region
// is free, copies a chunk into its slot and publishes it; the others wait
// for it, copy it out and say they consumed it. Root runs ahead of the
// slowest reader by at most the ring.
status shm_chunks(shm_group& shm, int root, const std::vector<std::pair<char*, int64_t>>& chunks, std::chrono::milliseconds timeout,
                  const std::function<bool()>& abandon, uint64_t& bytes) {
  const bool sending = shm.rank() == root;
  auto deadline = [&] { return std::chrono::steady_clock::now() + timeout; };
  constexpr std::chrono::microseconds spin{200};
  for (const auto& [base, n] : chunks) {
    auto region = shm.reserve((n + static_cast<int64_t>(sizeof(float)) - 1) / static_cast<int64_t>(sizeof(float)));
    if (!region) return region.err();
    const auto& g = region.value();
    if (sending) {
      if (auto st = shm.wait_free(g, deadline(), abandon, spin, "state transfer"); !st) return st;
      std::memcpy(shm.at(root, g), base, static_cast<size_t>(n));
    }
    shm.publish(g);
    if (!sending) {
      if (auto st = shm.wait_all(g.count, deadline(), abandon, spin, "state transfer"); !st) return st;
      std::memcpy(base, shm.at(root, g), static_cast<size_t>(n));
    }
    shm.consume(g.count);
    bytes += static_cast<uint64_t>(n);
  }
  return {};
}

// Chunks of at most half a ring slot: root fills one while the others
// copy out the one before.
uint64_t shm_chunk_bytes(const shm_group& shm, uint64_t chunk_bytes) {
  const uint64_t half = static_cast<uint64_t>(shm.capacity()) * sizeof(float) / 2 / 64 * 64;
  return std::max<uint64_t>(64, std::min(chunk_bytes, half));
}

}  // namespace

result<transfer_stats> broadcast_state(c10d::ProcessGroup& pg, int root, training_state& state, std::chrono::milliseconds timeout,
                                       const std::function<bool()>& abandon, int64_t& tag, int in_flight, uint64_t chunk_bytes, shm_group* shm) {
  const auto t0 = std::chrono::steady_clock::now();
  auto deadline = [&] { return std::chrono::steady_clock::now() + timeout; };
  c10d::BroadcastOptions bo;
  bo.rootRank = root;
  const bool receiving = pg.getRank() != root;
  const state_layout layout = layout_of(state);
  const uint64_t bytes = layout.replicated_bytes();
  // Root's step and stream length first: a receiver whose layout differs
  // fails here, before anything lands.
  std::vector<torch::Tensor> head{torch::tensor({state.step(), static_cast<int64_t>(bytes), tag}, torch::kInt64)};
  if (auto st = wait_work(pg.broadcast(head, bo), deadline(), abandon, "state transfer (header)"); !st) return st.err();
  const int64_t step = head[0][0].item<int64_t>();
  tag = head[0][2].item<int64_t>();
  if (static_cast<uint64_t>(head[0][1].item<int64_t>()) != bytes)
    return make_error("state transfer: rank " + std::to_string(root) + " holds " + std::to_string(head[0][1].item<int64_t>()) +
                      " bytes of state, this rank " + std::to_string(bytes) + " (another model?)");
  torch::NoGradGuard no_grad;
  // train.zero = 3: the parameters move with the shards (a peer's, or, when
  // the root read the state from a checkpoint, each rank's own read of it).
  const auto entries = transferred(layout, sharded_params(state));
  transfer_stats stats;
  if (shm) {
    if (auto st = shm_chunks(*shm, root, transfer_chunks(entries, shm_chunk_bytes(*shm, chunk_bytes)), timeout, abandon, stats.bytes); !st) {
      if (receiving) (void)state.reset_state();
      return st.err();
    }
    if (receiving) state.state_loaded(step);
    stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return stats;
  }
  // Chunks in flight, oldest first: each waited for before the next past
  // `in_flight` is issued.
  std::deque<std::pair<c10::intrusive_ptr<c10d::Work>, std::vector<torch::Tensor>>> flying;
  auto land_oldest = [&]() -> status {
    auto st = wait_work(flying.front().first, deadline(), abandon, "state transfer");
    if (st) stats.bytes += static_cast<uint64_t>(flying.front().second[0].numel());
    flying.pop_front();
    return st;
  };
  for (const auto& [base, n] : transfer_chunks(entries, chunk_bytes)) {
    std::vector<torch::Tensor> t{torch::from_blob(base, {n}, torch::kUInt8)};
    flying.emplace_back(pg.broadcast(t, bo), t);
    if (static_cast<int>(flying.size()) < std::max(1, in_flight)) continue;
    if (auto st = land_oldest(); !st) {
      if (receiving) (void)state.reset_state();
      return st.err();
    }
  }
  while (!flying.empty())
    if (auto st = land_oldest(); !st) {
      if (receiving) (void)state.reset_state();
      return st.err();
    }
  if (receiving) state.state_loaded(step);
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

}  // namespace dtactor
