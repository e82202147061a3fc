#include "rank/zero.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "model/flat_adamw.hpp"
#include "model/grad_norm.hpp"
#include "model/trainer.hpp"
#include "comm/communicator.hpp"
#include "comm/grad_sync.hpp"
#include "comm/peer_moves.hpp"
#include "comm/shm_group.hpp"

namespace dtactor {

namespace {
using clock_type = std::chrono::steady_clock;
using ranges = std::vector<std::pair<int64_t, int64_t>>;

// Gloo's send and receive works have no future (wait_work polls one): they
// are waited for directly, up to the timeout.
status wait_p2p(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout, const std::string& what) {
  try {
    work->wait(timeout);
    return {};
  } catch (const std::exception& e) {
    std::string m = e.what();
    return make_error(what + " failed: " + m.substr(0, m.find('\n')));
  }
}

// Moves before the first step: each piece of work waited for up to the
// timeout, nothing registered (the generation's end abandons none of it).
p2p_waits timed_waits(std::chrono::milliseconds timeout) {
  return {nullptr, [timeout](const c10::intrusive_ptr<c10d::Work>& w, const std::string& what) { return wait_p2p(w, timeout, what); }};
}

// Rank `rank` holds shard s (as its primary or a replica): it stepped the
// shard's parameters itself, bit for bit as the primary did (the same update
// on the same summed gradient), so it needs none of them from the primary.
bool holds(const shard_plan& plan, int s, int rank) {
  const auto& h = plan.shards[static_cast<size_t>(s)].holders;
  return std::find(h.begin(), h.end(), rank) != h.end();
}
// Every rank holds every shard (two ranks with two holders a shard): an
// all-gather would move nothing anyone lacks. The same answer on every rank.
bool everyone_holds_everything(const shard_plan& plan) {
  for (const auto& sh : plan.shards)
    if (static_cast<int>(sh.holders.size()) < plan.world() && sh.begin < sh.end) return false;
  return true;
}

// Elements [a, b) of the index space between the parameters and `buf` (its
// first b - a elements): to_buffer copies parameters -> buffer.
void move_params(flat_adamw& opt, int64_t a, int64_t b, const torch::Tensor& buf, bool to_buffer, bool copies = false) {
  int64_t at = 0;
  for (auto& v : copies ? opt.compute_views(a, b) : opt.param_views(a, b)) {
    auto part = buf.narrow(0, at, v.numel()).view(v.sizes());
    if (to_buffer)
      part.copy_(v);
    else
      v.copy_(part);
    at += v.numel();
  }
}

bool covers(const ranges& rs, int64_t a, int64_t b) {
  for (const auto& [x, y] : rs)
    if (x <= a && b <= y) return true;
  return false;
}
}  // namespace

std::shared_ptr<const zero2_grads> zero2_of(flat_adamw& opt, const shard_plan& plan) {
  auto z = std::make_shared<zero2_grads>();
  z->param_index = opt.param_index();
  for (int r = 0; r < plan.world(); ++r) z->held.push_back(plan.ranges_of(r));
  z->deliver = [&opt](int64_t index, const torch::Tensor& sum) { opt.grad_window(index, index + sum.numel()).copy_(sum); };
  return z;
}

namespace {
// Indices [first, last) of the gradient norm's ranges in shard s, checked:
// the plan's boundaries must be range boundaries (make_shard_plan cuts them
// so), else a rank would sum part of a range.
result<std::pair<size_t, size_t>> norm_slice(const index_ranges& rs, const shard_plan& plan, int s) {
  const auto& sh = plan.shards[static_cast<size_t>(s)];
  const auto slice = ranges_within(rs, sh.begin, sh.end);
  const int64_t from = slice.first < rs.size() ? rs[slice.first].first : plan.total;
  const int64_t to = slice.second < rs.size() ? rs[slice.second].first : plan.total;
  if (sh.begin < sh.end && (from != sh.begin || to != sh.end))
    return make_error("gradient norm: shard " + std::to_string(s) + " [" + std::to_string(sh.begin) + ", " + std::to_string(sh.end) +
                      ") does not begin and end at the norm's range boundaries");
  return slice;
}
}  // namespace

result<double> global_grad_norm(c10d::ProcessGroup& pg, flat_adamw& opt, const shard_plan& plan, std::chrono::milliseconds timeout,
                                const std::function<bool()>& abandon) {
  const int rank = pg.getRank();
  if (rank >= plan.world()) return make_error("gradient norm: rank " + std::to_string(rank) + " has no shard in the plan");
  const auto rs = opt.norm_ranges();
  const auto slice = norm_slice(rs, plan, rank);
  if (!slice) return slice.err();
  // The other ranks' values are zeros here: the allreduce adds exact zeros
  // to each value, in whatever order, so every rank gets every range's bits.
  auto t = torch::zeros({static_cast<int64_t>(rs.size())}, torch::kDouble);
  const auto mine = opt.grad_range_squares(rs, slice->first, slice->second);
  std::copy(mine.begin(), mine.end(), t.data_ptr<double>() + slice->first);
  std::vector<torch::Tensor> v{t};
  try {
    if (auto st = wait_work(pg.allreduce(v), clock_type::now() + timeout, abandon, "rank " + std::to_string(rank) + ": allreduce of the gradient norm");
        !st)
      return st.err();
  } catch (const std::exception& e) {
    std::string m = e.what();
    return make_error("allreduce of the gradient norm could not start: " + m.substr(0, m.find('\n')));
  }
  return norm_of_parts(std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel()));
}

result<bool> finish_interrupted_step(c10d::ProcessGroup& pg, training_state& state, std::chrono::milliseconds timeout,
                                     const std::function<bool()>& abandon) {
  const int world = pg.getSize();
  const auto norm = state.norm_of_last_step();
  double n = norm.value_or(0.0);
  int64_t bits = 0;
  std::memcpy(&bits, &n, sizeof bits);
  // [step, norm known, the norm's bits]
  auto row = torch::tensor({state.step(), norm ? int64_t{1} : int64_t{0}, bits}, torch::kInt64);
  std::vector<std::vector<torch::Tensor>> rows(1);
  for (int r = 0; r < world; ++r) rows[0].push_back(torch::empty_like(row));
  std::vector<torch::Tensor> ins{row};
  try {
    if (auto st = wait_work(pg.allgather(rows, ins), clock_type::now() + timeout, abandon, "agreement on an interrupted step"); !st) return st.err();
  } catch (const std::exception& e) {
    std::string m = e.what();
    return make_error("agreement on an interrupted step could not start: " + m.substr(0, m.find('\n')));
  }
  int64_t highest = 0;
  std::optional<double> norm_there;
  for (const auto& t : rows[0]) highest = std::max(highest, t[0].item<int64_t>());
  for (const auto& t : rows[0])
    if (t[0].item<int64_t>() == highest && t[1].item<int64_t>() != 0) {
      const int64_t b = t[2].item<int64_t>();
      double v = 0;
      std::memcpy(&v, &b, sizeof v);
      norm_there = v;
      break;
    }
  if (state.has_interrupted_step() && state.step() + 1 == highest && norm_there) {
    state.finish_interrupted_step(*norm_there);
    return true;
  }
  state.drop_interrupted_step();
  return false;
}

status gather_params(c10d::ProcessGroup& pg, flat_adamw& opt, const shard_plan& plan, std::chrono::milliseconds timeout,
                     const std::function<bool()>& abandon, int64_t block_elements) {
  const int world = pg.getSize(), rank = pg.getRank();
  if (world != plan.world())
    return make_error("parameter all-gather: the shard plan is for " + std::to_string(plan.world()) + " ranks, the group has " +
                      std::to_string(world));
  if (world == 1 || everyone_holds_everything(plan)) return {};
  torch::NoGradGuard no_grad;
  const int64_t largest = plan.largest();
  const int64_t block = std::max<int64_t>(1, std::min(block_elements, largest));
  // The parameters' dtype (all float groups in practice).
  auto any = opt.param_views(0, plan.total);
  if (any.empty()) return {};
  const auto opts = any.front().options();
  torch::Tensor in = torch::empty({block}, opts);
  std::vector<torch::Tensor> out;
  for (int r = 0; r < world; ++r) out.push_back(torch::empty({block}, opts));
  const auto& mine = plan.shards[static_cast<size_t>(rank)];
  for (int64_t off = 0; off < largest; off += block) {
    const int64_t a = std::min(mine.begin + off, mine.end), b = std::min(mine.begin + off + block, mine.end);
    if (a < b) move_params(opt, a, b, in, true);
    std::vector<std::vector<torch::Tensor>> outs{out};
    std::vector<torch::Tensor> ins{in};
    if (auto st = wait_work(pg.allgather(outs, ins), clock_type::now() + timeout, abandon, "parameter all-gather"); !st) return st;
    for (int r = 0; r < world; ++r) {
      if (r == rank || holds(plan, r, rank)) continue;
      const auto& sh = plan.shards[static_cast<size_t>(r)];
      const int64_t x = std::min(sh.begin + off, sh.end), y = std::min(sh.begin + off + block, sh.end);
      if (x < y) move_params(opt, x, y, outs[0][static_cast<size_t>(r)], false);
    }
  }
  return {};
}

namespace {
// One round over the segment's ring: a region of `floats` reserved (alike on
// every rank), this rank fills its copy once what was there is consumed,
// publishes, waits for every rank's, reads the copies, and says it
// consumed them. Rounds are in lockstep, so a region waits only for the
// slowest rank to finish reading the round a ring before.
status shm_round(shm_group& shm, int64_t floats, const std::function<void(float* mine)>& fill,
                 const std::function<void(const shm_group::region&)>& read, std::chrono::milliseconds timeout,
                 const std::function<bool()>& abandon, std::chrono::microseconds spin, const std::string& what) {
  auto g = shm.reserve(floats);
  if (!g) return make_error(what + ": " + g.message());
  const auto deadline = clock_type::now() + timeout;
  if (auto st = shm.wait_free(g.value(), deadline, abandon, spin, what); !st) return st;
  fill(shm.at(shm.rank(), g.value()));
  shm.publish(g.value());
  if (auto st = shm.wait_all(g.value().count, deadline, abandon, spin, what); !st) return st;
  read(g.value());
  shm.consume(g.value().count);
  return {};
}
}  // namespace

bool params_float32(const flat_adamw& opt, const shard_plan& plan) {
  for (const auto& v : opt.param_views(0, plan.total))
    if (v.scalar_type() != torch::kFloat) return false;
  return true;
}

bool shm_fits(const shm_group& shm, const flat_adamw& opt, const shard_plan& plan) {
  return plan.world() == shm.world() && shm.capacity() >= 64 && params_float32(opt, plan);
}

bool hosts_cover_every_shard(const shard_plan& plan, const std::vector<std::vector<int>>& hosts) {
  if (hosts.empty()) return false;
  for (const auto& members : hosts)
    for (int s = 0; s < plan.world(); ++s) {
      const auto& sh = plan.shards[static_cast<size_t>(s)];
      if (sh.begin >= sh.end) continue;
      bool held = false;
      for (int m : members) held = held || holds(plan, s, m);
      if (!held) return false;
    }
  return true;
}

namespace {

// Error: a shard some member lacks that no member holds.
result<host_streams> plan_host_streams(const shard_plan& plan, const std::vector<int>& members) {
  const int shards = plan.world(), n = static_cast<int>(members.size());
  host_streams out;
  out.provider.assign(static_cast<size_t>(shards), -1);
  out.at.assign(static_cast<size_t>(shards), 0);
  out.stream.assign(static_cast<size_t>(n), 0);
  for (int s = 0; s < shards; ++s) {
    const auto& sh = plan.shards[static_cast<size_t>(s)];
    if (sh.begin >= sh.end) continue;
    bool lacked = false;
    int p = -1;
    for (int i = 0; i < n; ++i) {
      const bool h = holds(plan, s, members[static_cast<size_t>(i)]);
      lacked = lacked || !h;
      if (h && (p < 0 || members[static_cast<size_t>(i)] == sh.holders.front())) p = i;
    }
    if (!lacked) continue;
    if (p < 0)
      return make_error("parameter all-gather: no rank of this host holds shard " + std::to_string(s) + " (elements [" + std::to_string(sh.begin) +
                        ", " + std::to_string(sh.end) + "))");
    out.provider[static_cast<size_t>(s)] = p;
    out.at[static_cast<size_t>(s)] = out.stream[static_cast<size_t>(p)];
    out.stream[static_cast<size_t>(p)] += sh.end - sh.begin;
  }
  return out;
}

}  // namespace

result<host_param_gather> host_param_gather::make(shm_group& shm, std::vector<int> members, flat_adamw& opt, shard_plan plan, bool copies) {
  const int n = shm.world();
  if (static_cast<int>(members.size()) != n)
    return make_error("parameter all-gather: the segment has " + std::to_string(n) + " ranks, the host " + std::to_string(members.size()));
  for (int m : members)
    if (m < 0 || m >= plan.world())
      return make_error("parameter all-gather: rank " + std::to_string(m) + " has no shard in a plan for " + std::to_string(plan.world()) + " ranks");
  auto streams = plan_host_streams(plan, members);
  if (!streams) return streams.err();
  return host_param_gather(shm, std::move(members), opt, std::move(plan), copies, std::move(streams.value()));
}

host_param_gather::host_param_gather(shm_group& shm, std::vector<int> members, flat_adamw& opt, shard_plan plan, bool copies, host_streams streams)
    : shm_(&shm), members_(std::move(members)), opt_(&opt), plan_(std::move(plan)), copies_(copies), streams_(std::move(streams)) {
  longest_ = *std::max_element(streams_.stream.begin(), streams_.stream.end());
  // Rounds of half the ring (a round never waits for the one before):
  // round i carries elements [i*block, (i+1)*block) of every rank's stream.
  block_ = std::max<int64_t>(1, std::min(longest_, shm.capacity() / 2 / 16 * 16));
}

int64_t host_param_gather::ring_floats() const { return longest_ == 0 ? 0 : (block_ + 15) / 16 * 16; }

std::pair<int64_t, int64_t> host_param_gather::piece(int s, int64_t off) const {
  const auto& sh = plan_.shards[static_cast<size_t>(s)];
  const int64_t a = streams_.at[static_cast<size_t>(s)];
  return {std::max(a, off), std::min(a + (sh.end - sh.begin), off + block_)};
}

// This rank's pieces of the round at `off` written into its region once
// every rank read what was there, and published.
status host_param_gather::publish_round(int64_t off, time_point deadline, const std::function<bool()>& abandon, std::chrono::microseconds spin) {
  const std::string what = "parameter all-gather (shared memory)";
  auto g = shm_->reserve(block_);
  if (!g) return make_error(what + ": " + g.message());
  if (auto st = shm_->wait_free(g.value(), deadline, abandon, spin, what); !st) return st;
  torch::NoGradGuard no_grad;
  float* slot = shm_->at(shm_->rank(), g.value());
  for (int s = 0; s < plan_.world(); ++s) {
    if (streams_.provider[static_cast<size_t>(s)] != shm_->rank()) continue;
    const auto [x, y] = piece(s, off);
    if (x >= y) continue;
    const int64_t base = plan_.shards[static_cast<size_t>(s)].begin - streams_.at[static_cast<size_t>(s)];
    move_params(*opt_, base + x, base + y, torch::from_blob(slot + (x - off), {y - x}, torch::kFloat), true, copies_);
  }
  shm_->publish(g.value());
  published_.push_back({off, g.value()});
  return {};
}

// The oldest published round: every other provider's pieces this rank
// lacks read once all are published; then consumed.
status host_param_gather::collect_round(time_point deadline, const std::function<bool()>& abandon, std::chrono::microseconds spin) {
  const auto [off, g] = published_.front();
  published_.pop_front();
  if (auto st = shm_->wait_all(g.count, deadline, abandon, spin, "parameter all-gather (shared memory)"); !st) return st;
  torch::NoGradGuard no_grad;
  const int me = shm_->rank(), rank = members_[static_cast<size_t>(me)];
  for (int s = 0; s < plan_.world(); ++s) {
    const int p = streams_.provider[static_cast<size_t>(s)];
    if (p < 0 || p == me || holds(plan_, s, rank)) continue;
    const auto [x, y] = piece(s, off);
    if (x >= y) continue;
    const int64_t base = plan_.shards[static_cast<size_t>(s)].begin - streams_.at[static_cast<size_t>(s)];
    move_params(*opt_, base + x, base + y, torch::from_blob(shm_->at(p, g) + (x - off), {y - x}, torch::kFloat), false, copies_);
  }
  shm_->consume(g.count);
  return {};
}

status host_param_gather::publish(time_point deadline, const std::function<bool()>& abandon, std::chrono::microseconds spin) {
  for (int64_t off = 0; off < longest_; off += block_)
    if (auto st = publish_round(off, deadline, abandon, spin); !st) return st;
  return {};
}

status host_param_gather::collect(time_point deadline, const std::function<bool()>& abandon, std::chrono::microseconds spin) {
  while (!published_.empty())
    if (auto st = collect_round(deadline, abandon, spin); !st) return st;
  return {};
}

status host_param_gather::run(std::chrono::milliseconds timeout, const std::function<bool()>& abandon, std::chrono::microseconds spin) {
  for (int64_t off = 0; off < longest_; off += block_) {
    const auto deadline = clock_type::now() + timeout;
    if (auto st = publish_round(off, deadline, abandon, spin); !st) return st;
    if (auto st = collect_round(deadline, abandon, spin); !st) return st;
  }
  return {};
}

status gather_params_host(shm_group& shm, const std::vector<int>& members, flat_adamw& opt, const shard_plan& plan,
                          std::chrono::milliseconds timeout, const std::function<bool()>& abandon, std::chrono::microseconds spin, bool copies) {
  auto g = host_param_gather::make(shm, members, opt, plan, copies);
  if (!g) return g.err();
  return g.value().run(timeout, abandon, spin);
}

status gather_params_shm(shm_group& shm, flat_adamw& opt, const shard_plan& plan, std::chrono::milliseconds timeout,
                         const std::function<bool()>& abandon, std::chrono::microseconds spin) {
  const int world = shm.world();
  if (world != plan.world())
    return make_error("parameter all-gather: the shard plan is for " + std::to_string(plan.world()) + " ranks, the segment has " +
                      std::to_string(world));
  if (world == 1 || everyone_holds_everything(plan)) return {};
  std::vector<int> members(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) members[static_cast<size_t>(r)] = r;
  return gather_params_host(shm, members, opt, plan, timeout, abandon, spin);
}

result<double> global_grad_norm_shm(shm_group& shm, flat_adamw& opt, const shard_plan& plan, std::chrono::milliseconds timeout,
                                    const std::function<bool()>& abandon, std::chrono::microseconds spin) {
  const int world = shm.world(), rank = shm.rank();
  if (rank >= plan.world() || world != plan.world())
    return make_error("gradient norm: rank " + std::to_string(rank) + " of " + std::to_string(world) + " has no shard in a plan for " +
                      std::to_string(plan.world()) + " ranks");
  const auto rs = opt.norm_ranges();
  std::vector<std::pair<size_t, size_t>> slices;
  size_t longest = 0;
  for (int r = 0; r < world; ++r) {
    auto sl = norm_slice(rs, plan, r);
    if (!sl) return sl.err();
    slices.push_back(*sl);
    longest = std::max(longest, sl->second - sl->first);
  }
  const auto [first, last] = slices[static_cast<size_t>(rank)];
  std::vector<double> parts(rs.size(), 0.0);
  const auto mine = opt.grad_range_squares(rs, first, last);
  std::copy(mine.begin(), mine.end(), parts.begin() + static_cast<std::ptrdiff_t>(first));
  // Each rank's values in rounds of half the ring; round i carries values
  // [i*block, (i+1)*block) of every rank's slice (doubles: two floats each).
  const size_t block = static_cast<size_t>(std::max<int64_t>(1, shm.capacity() / 4));
  auto count = [&](int r, size_t off) {
    const auto& sl = slices[static_cast<size_t>(r)];
    return std::min(block, sl.second - sl.first - std::min(off, sl.second - sl.first));
  };
  for (size_t off = 0; off < longest; off += block) {
    auto st = shm_round(
        shm, static_cast<int64_t>(2 * std::min(block, longest - off)),
        [&](float* slot) {
          if (const size_t n = count(rank, off)) std::memcpy(slot, mine.data() + off, sizeof(double) * n);
        },
        [&](const shm_group::region& g) {
          for (int r = 0; r < world; ++r)
            if (const size_t n = count(r, off); r != rank && n > 0)
              std::memcpy(parts.data() + slices[static_cast<size_t>(r)].first + off, shm.at(r, g), sizeof(double) * n);
        },
        timeout, abandon, spin, "rank " + std::to_string(rank) + ": sum of the gradient norm (shared memory)");
    if (!st) return st.err();
  }
  return norm_of_parts(parts);
}

namespace {

// Every rank's held ranges at the agreed step, and whether any rank's
// parameters may be a mix of two steps.
struct holdings {
  std::vector<ranges> held;
  bool any_mixed = false;
};

// All-gathers who holds what: each rank's held ranges (none unless
// `holds_current`) and its `params_mixed`, in a fixed-size row
// ([count, a0, b0, ..., a31, b31, parameters mixed]).
result<holdings> gather_holdings(c10d::ProcessGroup& pg, flat_adamw& opt, bool holds_current, bool params_mixed, std::chrono::milliseconds timeout,
                                 const std::function<bool()>& abandon) {
  constexpr int64_t max_ranges = 32;
  const int world = pg.getSize();
  const ranges mine = holds_current ? opt.held_ranges() : ranges{};
  if (static_cast<int64_t>(mine.size()) > max_ranges) return make_error("optimizer reshard: this rank holds more than 32 ranges");
  auto row = torch::zeros({2 + 2 * max_ranges}, torch::kInt64);
  row[0] = static_cast<int64_t>(mine.size());
  row[1 + 2 * max_ranges] = params_mixed ? 1 : 0;
  for (size_t i = 0; i < mine.size(); ++i) {
    row[static_cast<int64_t>(1 + 2 * i)] = mine[i].first;
    row[static_cast<int64_t>(2 + 2 * i)] = mine[i].second;
  }
  std::vector<std::vector<torch::Tensor>> rows(1);
  for (int r = 0; r < world; ++r) rows[0].push_back(torch::empty_like(row));
  std::vector<torch::Tensor> ins{row};
  if (auto st = wait_work(pg.allgather(rows, ins), clock_type::now() + timeout, abandon, "optimizer reshard (who holds what)"); !st) return st.err();
  holdings h;
  h.held.resize(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    auto v = rows[0][static_cast<size_t>(r)];
    h.any_mixed = h.any_mixed || v[1 + 2 * max_ranges].item<int64_t>() != 0;
    const int64_t n = std::clamp<int64_t>(v[0].item<int64_t>(), 0, max_ranges);
    for (int64_t i = 0; i < n; ++i) h.held[static_cast<size_t>(r)].emplace_back(v[1 + 2 * i].item<int64_t>(), v[2 + 2 * i].item<int64_t>());
  }
  return h;
}

// The segments of [0, total) cut at every boundary anyone's old or new
// ranges or a parameter group has: each has one holder set and one wanter set.
ranges cut_segments(const std::vector<ranges>& held, const shard_plan& next, flat_adamw& opt, int64_t total) {
  std::set<int64_t> cuts{0, total};
  for (const auto& h : held)
    for (const auto& [a, b] : h) cuts.insert(a), cuts.insert(b);
  for (int r = 0; r < next.world(); ++r)
    for (const auto& [a, b] : next.ranges_of(r)) cuts.insert(a), cuts.insert(b);
  for (int64_t base : opt.group_bases()) cuts.insert(base);
  ranges segments;
  for (auto it = cuts.begin(); std::next(it) != cuts.end(); ++it)
    if (*it < *std::next(it) && *std::next(it) <= total) segments.emplace_back(*it, *std::next(it));
  return segments;
}

// "elements [a, b), [c, d)": the segments nobody holds, adjacent ones
// merged; "" when every element has a holder.
std::string unheld(const ranges& segments, const std::vector<ranges>& held) {
  ranges lost;
  for (const auto& [a, b] : segments) {
    bool any = false;
    for (const auto& h : held) any = any || covers(h, a, b);
    if (any) continue;
    if (!lost.empty() && lost.back().second == a)
      lost.back().second = b;
    else
      lost.emplace_back(a, b);
  }
  std::string missing;
  for (const auto& [a, b] : lost) missing += (missing.empty() ? "elements [" : ", [") + std::to_string(a) + ", " + std::to_string(b) + ")";
  return missing;
}

// The lowest rank holding all of [a, b) (-1: none); every rank picks the same.
int first_holder(const std::vector<ranges>& held, int64_t a, int64_t b) {
  for (size_t r = 0; r < held.size(); ++r)
    if (covers(held[r], a, b)) return static_cast<int>(r);
  return -1;
}

// Each segment's moments go from its first holder to every rank that
// wants it and lacks it, point to point (tags from `tag` in segment order,
// the same on every rank): this rank's sends and receives, their tensors
// taken now (a receive's window made dense). `masters`: the segment's
// float32 masters too (sharded masters: a segment lies in one group, so
// they are one view).
std::vector<reshard_move> moment_moves(flat_adamw& opt, const ranges& segments, const std::vector<ranges>& held, const shard_plan& next, int rank,
                                       int tag, reshard_result& res, bool masters = false) {
  const int world = next.world();
  std::vector<reshard_move> out;
  for (const auto& [a, b] : segments) {
    const int source = first_holder(held, a, b);
    for (int r = 0; r < world; ++r) {
      if (r == source || !covers(next.ranges_of(r), a, b) || covers(held[static_cast<size_t>(r)], a, b)) continue;
      if (rank == source || rank == r) {
        const bool send = rank == source;
        auto [m, v] = opt.moments(a, b, send);
        out.push_back({m, send ? r : source, tag, send});
        out.push_back({v, send ? r : source, tag + 1, send});
        const auto bytes = static_cast<uint64_t>(2 * (b - a) * m.element_size());
        (send ? res.bytes_out : res.bytes_in) += bytes;
        if (!send) res.moments_in += bytes;
        if (masters)
          for (auto& p : opt.param_views(a, b)) {
            out.push_back({p, send ? r : source, tag + 2, send});
            (send ? res.bytes_out : res.bytes_in) += static_cast<uint64_t>(p.numel() * p.element_size());
          }
      }
      tag += masters ? 3 : 2;
    }
  }
  return out;
}

}  // namespace

status run_moves(c10d::ProcessGroup& pg, const std::vector<reshard_move>& moves, const local_peers& local, const p2p_waits& waits) {
  peer_moves mv(pg, local, waits);
  for (const auto& m : moves) {
    if (m.send)
      mv.send(m.t, m.peer, m.tag);
    else
      mv.recv(m.t, m.peer, m.tag);
  }
  return mv.finish();
}

namespace {

// Broadcasts every segment's parameters from its first holder, whose are
// the agreed step's.
status repair_params(c10d::ProcessGroup& pg, flat_adamw& opt, const ranges& segments, const std::vector<ranges>& held,
                     std::chrono::milliseconds timeout, const std::function<bool()>& abandon, reshard_result& res) {
  const int rank = pg.getRank();
  for (const auto& [a, b] : segments) {
    const int source = first_holder(held, a, b);
    c10d::BroadcastOptions bo;
    bo.rootRank = source;
    for (auto& v : opt.param_views(a, b)) {
      std::vector<torch::Tensor> t{v};
      if (auto st = wait_work(pg.broadcast(t, bo), clock_type::now() + timeout, abandon, "parameter repair after the reshard"); !st) return st.err();
      if (rank == source)
        res.bytes_out += static_cast<uint64_t>(v.numel() * v.element_size());
      else
        res.bytes_in += static_cast<uint64_t>(v.numel() * v.element_size());
    }
  }
  return {};
}

// train.zero = 3: each rank that now holds a segment it did not gets the
// segment's parameters from its first holder, point to point (as
// moment_moves, tags after its; a segment lies in one group, so it is one
// view), and the pieces of `everywhere` (the parameters of no unit, which
// every rank keeps) are broadcast from theirs. Nobody gets the parameters
// of shards it will not hold.
status move_sharded_params(c10d::ProcessGroup& pg, flat_adamw& opt, const ranges& segments, const std::vector<ranges>& held, const shard_plan& next,
                           const ranges& everywhere, const local_peers& local, std::chrono::milliseconds timeout, const std::function<bool()>& abandon,
                           reshard_result& res) {
  const int world = pg.getSize(), rank = pg.getRank();
  int tag = 1 << 20;
  std::vector<reshard_move> moves;
  for (const auto& [a, b] : segments) {
    const int source = first_holder(held, a, b);
    for (int r = 0; r < world; ++r, ++tag) {
      if (r == source || !covers(next.ranges_of(r), a, b) || covers(held[static_cast<size_t>(r)], a, b) || (rank != source && rank != r)) continue;
      for (auto& v : opt.param_views(a, b)) {
        (rank == source ? res.bytes_out : res.bytes_in) += static_cast<uint64_t>(v.numel() * v.element_size());
        moves.push_back({v, rank == source ? r : source, tag, rank == source});
      }
    }
  }
  if (auto st = run_moves(pg, moves, local, timed_waits(timeout)); !st) return make_error("parameter reshard: " + st.message());
  for (const auto& [a, b] : segments)
    for (const auto& [x, y] : everywhere) {
      const int64_t lo = std::max(a, x), hi = std::min(b, y);
      if (lo >= hi) continue;
      c10d::BroadcastOptions bo;
      bo.rootRank = first_holder(held, a, b);
      for (auto& v : opt.param_views(lo, hi)) {
        std::vector<torch::Tensor> t{v};
        if (auto st = wait_work(pg.broadcast(t, bo), clock_type::now() + timeout, abandon, "parameter reshard (the parameters of no unit)"); !st)
          return st.err();
        (rank == bo.rootRank ? res.bytes_out : res.bytes_in) += static_cast<uint64_t>(v.numel() * v.element_size());
      }
    }
  return {};
}

}  // namespace

namespace {

// Both halves' start: who holds what, the segments, and the elements
// nobody holds ("" when every one has a holder).
struct reshard_start {
  holdings who;
  ranges segments;
  std::string missing;
};
result<reshard_start> start_reshard(c10d::ProcessGroup& pg, flat_adamw& opt, const shard_plan& next, bool holds_current, bool params_mixed,
                                    std::chrono::milliseconds timeout, const std::function<bool()>& abandon) {
  const int world = pg.getSize();
  const int64_t total = opt.total_elements();
  if (next.world() != world || next.total != total)
    return make_error("optimizer reshard: the shard plan is for " + std::to_string(next.world()) + " ranks and " + std::to_string(next.total) +
                      " elements, the group has " + std::to_string(world) + " ranks and the optimizer " + std::to_string(total));
  auto who = gather_holdings(pg, opt, holds_current, params_mixed, timeout, abandon);
  if (!who) return who.err();
  reshard_start r;
  r.who = std::move(who.value());
  r.segments = cut_segments(r.who.held, next, opt, total);
  r.missing = unheld(r.segments, r.who.held);
  return r;
}

}  // namespace

result<reshard_result> reshard_optimizer(c10d::ProcessGroup& pg, flat_adamw& opt, const shard_plan& next, bool holds_current, bool params_mixed,
                                         std::chrono::milliseconds timeout, const std::function<bool()>& abandon, const ranges* params_everywhere,
                                         const local_peers* local) {
  const auto t0 = clock_type::now();
  const int rank = pg.getRank();
  torch::NoGradGuard no_grad;
  auto start = start_reshard(pg, opt, next, holds_current, params_mixed, timeout, abandon);
  if (!start) return start.err();
  const std::vector<ranges>& held = start->who.held;
  const ranges& segments = start->segments;
  // Every element must have a holder, or nothing moves.
  reshard_result res;
  res.missing = start->missing;
  if (!res.missing.empty()) {
    res.complete = false;
    return res;
  }
  opt.shard(next.ranges_of(rank));  // keeps what this rank held of them; the old windows stay until the sends are done
  const local_peers over_group = local_peers::none(pg.getSize());
  const local_peers& peers = local ? *local : over_group;
  if (auto st = run_moves(pg, moment_moves(opt, segments, held, next, rank, 0, res), peers, timed_waits(timeout)); !st) return make_error("optimizer reshard: " + st.message());
  opt.drop_retired();
  // The parameters too, from the same holders, when a rank's last all-gather
  // failed after it stepped its own shards, so its other parameters may be
  // a mix of two steps (and it may be the root the others took the
  // replicated state from).
  if (params_everywhere) {
    if (auto st = move_sharded_params(pg, opt, segments, held, next, *params_everywhere, peers, timeout, abandon, res); !st) return st.err();
  } else if (start->who.any_mixed) {
    if (auto st = repair_params(pg, opt, segments, held, timeout, abandon, res); !st) return st.err();
  }
  res.seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
  return res;
}

result<reshard_plan> plan_reshard(c10d::ProcessGroup& pg, flat_adamw& opt, const shard_plan& next, bool holds_current, std::chrono::milliseconds timeout,
                                  const std::function<bool()>& abandon, int tag_base, bool masters) {
  const auto t0 = clock_type::now();
  torch::NoGradGuard no_grad;
  auto start = start_reshard(pg, opt, next, holds_current, false, timeout, abandon);
  if (!start) return start.err();
  reshard_plan p;
  p.totals.missing = start->missing;
  if (!p.totals.missing.empty()) {
    p.totals.complete = false;
    return p;
  }
  opt.shard(next.ranges_of(pg.getRank()));
  p.moves = moment_moves(opt, start->segments, start->who.held, next, pg.getRank(), tag_base, p.totals, masters);
  p.totals.seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
  return p;
}

}  // namespace dtactor
