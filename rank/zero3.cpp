#include "rank/zero3.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "base/ranges.hpp"
#include "comm/communicator.hpp"
#include "comm/shm_group.hpp"
#include "model/flat_adamw.hpp"
#include "rank/zero.hpp"

namespace dtactor {

namespace {

using clock_type = std::chrono::steady_clock;

// The whole pages inside [p, p + bytes) handed back to the kernel: they read
// as zeros until written, and take no memory.
void give_back(void* p, int64_t bytes) {
  static const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = (a + page - 1) / page * page, last = (a + static_cast<uintptr_t>(bytes)) / page * page;
  if (first < last) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

}  // namespace

result<unit_layout> unit_layout_of(const flat_adamw& opt, const std::vector<param_unit>& units) {
  unit_layout out;
  index_spans all;
  for (const auto& u : units) {
    index_spans spans;
    for (const auto& p : u.params) {
      auto r = opt.range_of(p);
      if (!r) {
        if (!p.requires_grad()) continue;
        return make_error("train.zero = 3: a parameter of unit " + u.name + " is not one the optimizer steps");
      }
      spans.push_back(*r);
    }
    spans = normalized(std::move(spans));
    for (const auto& s : spans) all.push_back(s);
    out.names.push_back(u.name);
    out.units.push_back(std::move(spans));
  }
  int64_t covered = 0;
  for (const auto& [a, b] : all) covered += b - a;
  all = normalized(std::move(all));
  int64_t distinct = 0;
  for (const auto& [a, b] : all) distinct += b - a;
  if (distinct != covered) return make_error("train.zero = 3: a parameter belongs to two units");
  out.root = spans_outside({{0, opt.total_elements()}}, all);
  return out;
}

status make_initial_units(flat_adamw& opt, const std::vector<param_unit>& units, const index_spans& ranges) {
  torch::NoGradGuard no_grad;
  for (const auto& u : units) {
    if (!u.initial) continue;
    std::vector<std::pair<int64_t, int64_t>> at;  // each parameter's place
    bool reached = false;
    for (const auto& p : u.params) {
      const auto r = opt.range_of(p);
      at.emplace_back(r ? r->first : -1, r ? r->second : -1);
      for (const auto& [x, y] : ranges) reached = reached || (r && x < r->second && y > r->first);
    }
    if (!reached) continue;
    std::vector<torch::Tensor> values;
    try {
      values = u.initial();
    } catch (const std::exception& e) {
      return make_error("unit " + u.name + ": its initial values: " + e.what());
    }
    if (values.size() != u.params.size()) return make_error("unit " + u.name + ": its initial values are not its parameters");
    for (size_t i = 0; i < values.size(); ++i) {
      const auto [a, b] = at[i];
      if (a < 0) continue;
      if (values[i].numel() != b - a) return make_error("unit " + u.name + ": an initial value of another size than its parameter");
      const auto flat = values[i].contiguous().view({-1});
      for (const auto& [x, y] : ranges) {
        const int64_t lo = std::max(a, x), hi = std::min(b, y);
        if (lo >= hi) continue;
        int64_t from = lo - a;
        for (auto& v : opt.param_views(lo, hi)) {
          v.copy_(flat.narrow(0, from, v.numel()));
          from += v.numel();
        }
      }
    }
  }
  return {};
}

index_spans spans_outside(const index_spans& spans, const index_spans& held) {
  index_spans out;
  for (auto [a, b] : spans) {
    for (const auto& [x, y] : held) {
      if (y <= a || x >= b) continue;
      if (x > a) out.emplace_back(a, x);
      a = std::max(a, y);
      if (a >= b) break;
    }
    if (a < b) out.emplace_back(a, b);
  }
  return out;
}

gather_route gather_route::through(std::shared_ptr<shm_group> segment, std::vector<int> members, bool within_hosts) {
  if (members.size() > 1 && (!segment || segment->world() != static_cast<int>(members.size()))) return over_group();
  if (members.empty()) return over_group();
  return {std::move(segment), std::move(members), within_hosts};
}

unit_gatherer::unit_gatherer(c10::intrusive_ptr<c10d::ProcessGroup> pg, flat_adamw& opt, const shard_plan& plan, unit_layout layout,
                             std::chrono::milliseconds timeout, std::function<bool()> abandon, gather_route route,
                             std::chrono::microseconds spin, unit_policy policy)
    : pg_(std::move(pg)),
      opt_(opt),
      plan_(plan),
      layout_(std::move(layout)),
      timeout_(timeout),
      abandon_(std::move(abandon)),
      route_(std::move(route)),
      spin_(spin),
      policy_(policy) {
  const auto held = plan_.ranges_of(pg_->getRank());
  for (const auto& u : layout_.units) {
    released_.push_back(spans_outside(u, held));
    held_.push_back(spans_outside(u, released_.back()));
  }
  root_released_ = spans_outside(layout_.root, held);
  root_held_ = spans_outside(layout_.root, root_released_);
  // Released: what a rank does not hold may be stale (the reshard moved
  // only its shards' and the root's); reshard() gives the pages back.
  state_.resize(layout_.units.size());
  mixed_ = opt_.mixed();
  if (rounds_held()) opt_.copies_by_gatherer(true);
  pages_out_.assign(layout_.units.size(), 0);
  if (policy_ == unit_policy::each_pass) make_pool();
}

void unit_gatherer::make_pool() {
  size_t largest = 0, second = 0;
  for (int u = 0; u < units(); ++u) {
    size_t bytes = 0;
    for (const auto& v : written_views(u))
      if (poolable(v)) bytes += static_cast<size_t>(v.numel()) * v.element_size();
    second = std::max(second, std::min(largest, bytes));
    largest = std::max(largest, bytes);
  }
  if (largest > 0) pool_ = std::make_unique<page_pool>(largest + second);
}

bool unit_gatherer::poolable(const torch::Tensor& v) const {
  return anonymous_.cover(v.data_ptr(), static_cast<size_t>(v.numel()) * v.element_size());
}

std::vector<torch::Tensor> unit_gatherer::written_views(int unit) const {
  std::vector<torch::Tensor> out;
  const auto u = static_cast<size_t>(unit);
  for (const auto& [a, b] : released_[u])
    for (auto& v : mixed_ ? opt_.compute_views(a, b) : opt_.param_views(a, b)) out.push_back(std::move(v));
  if (rounds_held())
    for (const auto& [a, b] : held_[u])
      for (auto& v : opt_.compute_views(a, b)) out.push_back(std::move(v));
  return out;
}

// The written views' bytes, adjacent ones joined (the pool moves whole
// page-table spans: the longer the run, the fewer pages left out), split
// into what the pool covers and the rest.
unit_gatherer::byte_runs unit_gatherer::written_runs(int unit) const {
  byte_runs out;
  for (const auto& v : written_views(unit)) {
    auto* p = static_cast<char*>(v.data_ptr());
    const auto n = static_cast<size_t>(v.numel()) * v.element_size();
    auto& to = poolable(v) ? out.pooled : out.other;
    if (!to.empty() && to.back().first + to.back().second == p)
      to.back().second += n;
    else
      to.emplace_back(p, n);
  }
  return out;
}

void unit_gatherer::hand_back(int unit) {
  const bool pooled = pool_ && !pages_out_[static_cast<size_t>(unit)];
  const auto runs = written_runs(unit);
  for (const auto& [p, n] : runs.pooled)
    if (pooled)
      pool_->give(p, n);
    else
      give_back(p, static_cast<int64_t>(n));
  for (const auto& [p, n] : runs.other) give_back(p, static_cast<int64_t>(n));
  pages_out_[static_cast<size_t>(unit)] = 1;
}

void unit_gatherer::take_back(int unit) {
  if (pool_ && pages_out_[static_cast<size_t>(unit)])
    for (const auto& [p, n] : written_runs(unit).pooled) pool_->take(p, n);
  pages_out_[static_cast<size_t>(unit)] = 0;
}

unit_gatherer::~unit_gatherer() {
  if (rounds_held()) opt_.copies_by_gatherer(false);
  // A gather still in flight writes into the parameters: let it finish
  // (or fail) before they can go.
  for (auto& s : state_)
    for (auto& w : s.works) try {
        w->wait(timeout_);
      } catch (...) {
      }
}

void unit_gatherer::fail(const std::string& why) {
  if (failure_.empty()) failure_ = why;
}

status unit_gatherer::failure() const {
  if (failure_.empty()) return {};
  return make_error(failure_);
}

// Each piece of `spans`, from its shard's primary to every rank: the
// masters, or the bf16 copies as bytes (Gloo broadcasts no bf16).
status unit_gatherer::start(const index_spans& spans, std::vector<c10::intrusive_ptr<c10d::Work>>& works, bool masters) {
  const bool copies = !masters && opt_.mixed();
  try {
    for (const auto& [a, b] : spans)
      for (int s = 0; s < plan_.world(); ++s) {
        const auto& sh = plan_.shards[static_cast<size_t>(s)];
        const int64_t x = std::max(a, sh.begin), y = std::min(b, sh.end);
        if (x >= y) continue;
        c10d::BroadcastOptions bo;
        bo.rootRank = sh.holders.front();
        for (auto& v : copies ? opt_.compute_views(x, y) : opt_.param_views(x, y)) {
          std::vector<torch::Tensor> t{copies ? torch::from_blob(v.data_ptr(), {v.numel() * static_cast<int64_t>(v.element_size())}, torch::kByte) : v};
          works.push_back(pg_->broadcast(t, bo));
        }
      }
  } catch (const std::exception& e) {
    std::string m = e.what();
    return make_error("parameter gather could not start: " + m.substr(0, m.find('\n')));
  }
  return {};
}

status unit_gatherer::wait(std::vector<c10::intrusive_ptr<c10d::Work>>& works) {
  const auto deadline = clock_type::now() + timeout_;
  for (auto& w : works)
    if (auto st = wait_work(w, deadline, abandon_, "rank " + std::to_string(pg_->getRank()) + ": parameter gather"); !st) {
      works.clear();
      return st;
    }
  works.clear();
  return {};
}

// Each span's host all-gather through the segment: its pieces written by
// their primaries and read by the ranks lacking them (rank/zero, over a
// plan cut down to the span).
result<std::vector<host_param_gather>> unit_gatherer::segment_gathers(const index_spans& spans, bool masters) {
  std::vector<host_param_gather> out;
  for (const auto& [a, b] : spans) {
    shard_plan cut = plan_;
    for (auto& sh : cut.shards) {
      sh.begin = std::min(std::max(sh.begin, a), b);
      sh.end = std::max(std::min(sh.end, b), sh.begin);
    }
    auto g = host_param_gather::make(*route_.segment, route_.members, opt_, std::move(cut), !masters && opt_.mixed());
    if (!g) return g.err();
    out.push_back(std::move(g.value()));
  }
  return out;
}

// The spans gathered now, a round at a time (after the unit published
// ahead, if any: the ring is read in the order it was written).
status unit_gatherer::through_segment(const index_spans& spans, bool masters) {
  if (!route_.segment) return {};  // alone on its host: it holds every shard
  if (ahead_ >= 0) settle(ahead_);
  if (!failure_.empty()) return failure();
  auto gathers = segment_gathers(spans, masters);
  if (!gathers) return gathers.err();
  for (auto& g : gathers.value())
    if (auto st = g.run(timeout_, abandon_, spin_); !st) return st;
  return {};
}

status unit_gatherer::gather_now(const index_spans& spans, bool masters) {
  if (through_shared_memory()) return through_segment(spans, masters);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  if (auto st = start(spans, works, masters); !st) return st;
  return wait(works);
}

void unit_gatherer::begin_gather(int unit) {
  if (unit < 0 || unit >= units() || !failure_.empty()) return;
  auto& s = state_[static_cast<size_t>(unit)];
  if (s.is != residency::released) return;
  if (through_shared_memory()) return publish_ahead(unit);
  s.is = residency::in_flight;
  take_back(unit);
  round_held(unit);
  if (auto st = start(layout_.units[static_cast<size_t>(unit)], s.works); !st) fail(st.message());
}

// Through shared memory: this rank's pieces of `unit` written and
// published now, the others' read when it is needed (settle), so that a
// rank waits only for its peers to have started the gather, not to need
// it. Only when every round fits half the ring at once; the unit published
// ahead before settles first (one at a time: the ring is read in order).
void unit_gatherer::publish_ahead(int unit) {
  if (!route_.segment) return;  // alone on its host: nothing to gather
  if (ahead_ >= 0) settle(ahead_);
  auto gathers = segment_gathers(layout_.units[static_cast<size_t>(unit)], false);
  if (!gathers) return fail(gathers.message());
  int64_t floats = 0;
  for (const auto& g : gathers.value()) {
    if (!g.ahead()) return;
    floats += g.ring_floats();
  }
  if (floats > route_.segment->capacity() / 2 || !failure_.empty()) return;
  auto& s = state_[static_cast<size_t>(unit)];
  s.is = residency::in_flight;
  ahead_ = unit;
  take_back(unit);
  round_held(unit);
  const auto deadline = clock_type::now() + timeout_;
  for (auto& g : gathers.value())
    if (auto st = g.publish(deadline, abandon_, spin_); !st) return fail(st.message());
  s.ahead = std::move(gathers.value());
}

// A gather in flight completed: the broadcasts waited for, or the pieces
// published ahead read from the segment.
void unit_gatherer::settle(int unit) {
  auto& s = state_[static_cast<size_t>(unit)];
  if (s.is != residency::in_flight) return;
  if (auto st = wait(s.works); !st) fail(st.message());
  const auto deadline = clock_type::now() + timeout_;
  for (auto& g : s.ahead)
    if (failure_.empty())
      if (auto st = g.collect(deadline, abandon_, spin_); !st) fail(st.message());
  s.ahead.clear();
  if (ahead_ == unit) ahead_ = -1;
  s.is = residency::resident;
}

void unit_gatherer::finish_gather(int unit) {
  if (unit < 0 || unit >= units()) return;
  auto& s = state_[static_cast<size_t>(unit)];
  begin_gather(unit);
  if (through_shared_memory() && s.is == residency::released) {  // not published ahead: a round at a time
    take_back(unit);
    round_held(unit);
    if (failure_.empty())
      if (auto st = through_segment(layout_.units[static_cast<size_t>(unit)]); !st) fail(st.message());
    s.is = residency::resident;
    return;
  }
  settle(unit);
}

// train.precision = bf16: masters gathered (the root's), rounded into the
// copy they compute with. A unit's copy is gathered as such from the
// holders, which round their own shards right before (round_held).
void unit_gatherer::round_gathered(const index_spans& spans) {
  for (const auto& [a, b] : spans) opt_.round_into_compute(a, b);
}

void unit_gatherer::round_held(int unit) {
  if (rounds_held()) round_gathered(held_[static_cast<size_t>(unit)]);
}

void unit_gatherer::before_forward(int unit) {
  const auto t = clock_type::now();
  finish_gather(unit);
  begin_gather(unit + 1);
  pass_s_ += std::chrono::duration<double>(clock_type::now() - t).count();
}

void unit_gatherer::after_forward(int unit) {
  if (unit == units() - 1 && torch::GradMode::is_enabled()) return;
  const auto t = clock_type::now();
  release(unit);
  pass_s_ += std::chrono::duration<double>(clock_type::now() - t).count();
}

void unit_gatherer::before_backward(int unit) {
  const auto t = clock_type::now();
  finish_gather(unit);
  begin_gather(unit - 1);
  pass_s_ += std::chrono::duration<double>(clock_type::now() - t).count();
}

void unit_gatherer::after_backward(int unit) {
  const auto t = clock_type::now();
  release(unit);
  pass_s_ += std::chrono::duration<double>(clock_type::now() - t).count();
}

void unit_gatherer::release(int unit) {
  if (unit == units() && root_sharded()) return release_root_masters();
  if (unit < 0 || unit >= units()) return;
  settle(unit);
  state_[static_cast<size_t>(unit)].is = residency::released;
  if (policy_ == unit_policy::copies_resident) {  // the masters outside its shards (the digest's); the copies stay whole
    for (const auto& [a, b] : released_[static_cast<size_t>(unit)])
      for (auto& v : opt_.param_views(a, b)) give_back(v.data_ptr(), v.numel() * static_cast<int64_t>(v.element_size()));
    return;
  }
  // What the gathers write: the masters outside its shards, or in bf16 the
  // copies (its own shards' too: round_held makes them again).
  hand_back(unit);
  if (mixed_)  // and the masters outside its shards, which only the digest gathers
    for (const auto& [a, b] : released_[static_cast<size_t>(unit)])
      for (auto& v : opt_.param_views(a, b)) give_back(v.data_ptr(), v.numel() * static_cast<int64_t>(v.element_size()));
}

void unit_gatherer::release_root_masters() {
  for (const auto& [a, b] : root_released_)
    for (auto& v : opt_.param_views(a, b)) give_back(v.data_ptr(), v.numel() * static_cast<int64_t>(v.element_size()));
}

status unit_gatherer::after_update() {
  if (policy_ == unit_policy::copies_resident) return gather_copies();
  for (int u = 0; u < units(); ++u) release(u);
  if (!failure_.empty()) return failure();
  if (root_sharded()) {  // the primaries' shards of the root rounded, then its copies from them
    round_gathered(root_held_);
    return gather_now(layout_.root);
  }
  if (auto st = gather_now(layout_.root, true); !st) return st;
  round_gathered(layout_.root);
  return {};
}

// copies_resident: this rank's shards rounded into the copies, then every
// shard's copies from its primary, in one go (the units matter only to the
// digest's gathers of masters, a unit at a time).
status unit_gatherer::gather_copies() {
  if (!failure_.empty()) return failure();
  for (const auto& [a, b] : plan_.ranges_of(pg_->getRank())) opt_.round_into_compute(a, b);
  return gather_now({{0, plan_.total}});
}

// The unit whose spans hold `index`; units() for the root's when
// root_sharded(), else -1.
int unit_gatherer::unit_at(int64_t index) const {
  for (int u = 0; u < units(); ++u)
    for (const auto& [a, b] : layout_.units[static_cast<size_t>(u)])
      if (index >= a && index < b) return u;
  return root_sharded() ? units() : -1;
}

void unit_gatherer::before_reading(const torch::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return;
  const auto at = opt_.index_at(t.data_ptr());
  if (!at) return;
  const int unit = unit_at(*at);
  if (unit < 0 || unit == reading_) return;
  release(reading_);
  reading_ = unit;
  if (opt_.mixed()) {  // the digest reads the masters: they are gathered as such
    const bool root = unit == units();
    if (auto st = gather_now(root ? layout_.root : layout_.units[static_cast<size_t>(unit)], true); !st) fail(st.message());
    if (!root) state_[static_cast<size_t>(unit)].is = residency::resident;
    return;
  }
  finish_gather(unit);
}

status unit_gatherer::done_reading() {
  release(std::exchange(reading_, -1));
  return failure();
}

void unit_gatherer::reshard() {
  for (int u = 0; u < units(); ++u) release(u);
  if (policy_ == unit_policy::copies_resident)  // also the pages across units' boundaries
    for (const auto& [a, b] : spans_outside({{0, plan_.total}}, plan_.ranges_of(pg_->getRank())))
      for (auto& v : opt_.param_views(a, b)) give_back(v.data_ptr(), v.numel() * static_cast<int64_t>(v.element_size()));
  if (root_sharded()) return release_root_masters();  // its copies: after_update()
  round_gathered(layout_.root);  // moved with the shards, or received, as masters
}

void unit_gatherer::idle_pass() {
  for (int u = 0; u < units(); ++u) {
    before_forward(u);
    after_forward(u);
  }
  for (int u = units() - 1; u >= 0; --u) {
    before_backward(u);
    after_backward(u);
  }
}

int64_t unit_gatherer::resident_bytes() const {
  int64_t elements = opt_.total_elements();
  for (const auto& spans : released_)
    for (const auto& [a, b] : spans) elements -= b - a;
  if (policy_ == unit_policy::copies_resident) return 4 * elements + 2 * opt_.total_elements();  // held masters, every copy
  int64_t root = 0;
  for (const auto& [a, b] : layout_.root) root += b - a;
  if (root_sharded())
    for (const auto& [a, b] : root_released_) elements -= b - a;
  return 4 * elements + (mixed_ ? 2 * root : 0);  // fp32 (masters); bf16: the held masters and the copies of no unit's
}

unit_layout layout_for(unit_layout task_layout, unit_policy policy) {
  if (policy == unit_policy::each_pass || task_layout.root.empty()) return task_layout;
  task_layout.units.push_back(std::move(task_layout.root));
  task_layout.names.push_back("(parameters of no unit)");
  task_layout.root.clear();
  return task_layout;
}

namespace {

class zero3_param_sync final : public param_sync {
 public:
  zero3_param_sync(std::unique_ptr<param_sync> inner, std::shared_ptr<unit_gatherer> gate, std::string backend)
      : inner_(std::move(inner)), gate_(std::move(gate)), backend_(std::move(backend)) {}
  bool sharded_norm() const override { return inner_->sharded_norm(); }
  result<double> global_norm() override { return inner_->global_norm(); }
  status gather() override { return gate_->after_update(); }
  std::string describe() const override {
    if (gate_->policy() == unit_policy::copies_resident)
      return "as whole bf16 copies after each update " + path() + " (" + std::to_string(gate_->units()) +
             " units; the float32 masters sharded)" + (inner_->sharded_norm() ? ", the gradient norm " + inner_->describe() : "");
    int64_t root = 0;
    for (const auto& [a, b] : gate_->layout().root) root += b - a;
    return "a unit at a time " + path() + " (" + std::to_string(gate_->units()) + " units; " + std::to_string(root) +
           " parameters in none, " + (gate_->root_sharded() ? "their bf16 copies on every rank, their masters sharded" : "resident on every rank") +
           "), the gradient norm " + inner_->describe();
  }
  status gathered() override { return gate_->failure(); }
  void idle_pass() override {
    if (gathers_in_passes()) gate_->idle_pass();
  }
  bool gathers_in_passes() const override { return gate_->policy() == unit_policy::each_pass; }
  double take_pass_gather_s() override { return gate_->take_pass_seconds(); }

 private:
  std::string path() const {
    return !gate_->through_shared_memory() ? "over " + backend_
           : gate_->within_hosts()         ? "through shared memory within each host (every host holds every shard)"
                                           : "through shared memory";
  }

  std::unique_ptr<param_sync> inner_;
  std::shared_ptr<unit_gatherer> gate_;
  std::string backend_;
};

}  // namespace

std::unique_ptr<param_sync> zero3_sync(std::unique_ptr<param_sync> inner, std::shared_ptr<unit_gatherer> gate, std::string backend) {
  return std::make_unique<zero3_param_sync>(std::move(inner), std::move(gate), std::move(backend));
}

}  // namespace dtactor
