#include "runtime/grad_sync.hpp"

#include "runtime/communicator.hpp"

#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <atomic>
#include <functional>

namespace dtactor {

namespace {

using clock_type = std::chrono::steady_clock;

int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now().time_since_epoch()).count(); }

double seconds_between(clock_type::time_point a, clock_type::time_point b) { return std::chrono::duration<double>(b - a).count(); }

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

}  // namespace

std::vector<std::vector<int>> group_by_host(const std::vector<std::string>& keys) {
  std::vector<std::vector<int>> hosts;
  std::vector<std::string> seen;
  for (size_t r = 0; r < keys.size(); ++r) {
    const auto it = std::find(seen.begin(), seen.end(), keys[r]);
    if (it == seen.end()) {
      seen.push_back(keys[r]);
      hosts.push_back({static_cast<int>(r)});
    } else {
      hosts[static_cast<size_t>(it - seen.begin())].push_back(static_cast<int>(r));
    }
  }
  return hosts;
}

std::string exchange_plan::describe(const std::string& backend) const {
  if (hierarchical) {
    std::string s = host_ranks > 1 && shm ? "gradients over shared memory within the host (" + std::to_string(host_ranks) + " ranks)"
                                          : "gradients of this host's only rank";
    s += " and " + backend + " across " + std::to_string(host_count) + " hosts";
    return s + (hosts ? ", this rank exchanging for its host" : "");
  }
  if (shm) return "gradients over shared memory";
  return "gradients over " + backend + (why_not.empty() ? "" : " (no shared memory: " + why_not + ")");
}

namespace {
std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
std::string string_of(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }
}  // namespace

result<exchange_plan> setup_exchange(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, int64_t floats,
                                     const communicator_options& co, const std::string& host_key) {
  exchange_plan out;
  try {
    store->set("host/" + std::to_string(rank), bytes_of(host_key));
    std::vector<std::string> keys;
    for (int r = 0; r < world; ++r) keys.push_back(string_of(store->get("host/" + std::to_string(r))));
    const auto hosts = group_by_host(keys);
    out.host_count = static_cast<int>(hosts.size());
    size_t mine = 0, local = 0, most = 0;
    for (size_t h = 0; h < hosts.size(); ++h) {
      most = std::max(most, hosts[h].size());
      for (size_t l = 0; l < hosts[h].size(); ++l)
        if (hosts[h][l] == rank) mine = h, local = l;
    }
    out.host_ranks = static_cast<int>(hosts[mine].size());
    if (hosts.size() == 1) {
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>("shm", store);
      auto joined = shm_group::join(*prefixed, rank, world, floats, &out.why_not);
      if (!joined) return joined.err();
      out.shm = joined.value();
      return out;
    }
    if (most == 1) {
      out.why_not = "every rank on a host of its own (another machine, host name or network namespace)";
      return out;
    }
    // Hierarchical: shared memory within each host, one rank per host on the wire.
    std::string problem;
    if (hosts[mine].size() > 1) {
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>("shm/h" + std::to_string(mine), store);
      std::string why;
      auto joined = shm_group::join(*prefixed, static_cast<int>(local), static_cast<int>(hosts[mine].size()), floats, &why);
      if (!joined) return joined.err();
      if (!joined.value()) problem = "host " + std::to_string(mine) + ": " + why;
      out.shm = joined.value();
    }
    if (local == 0) store->set("hier/" + std::to_string(mine), bytes_of(problem.empty() ? "1" : "0" + problem));
    for (size_t h = 0; h < hosts.size(); ++h) {
      const std::string ok = string_of(store->get("hier/" + std::to_string(h)));
      if (ok != "1" && out.why_not.empty()) out.why_not = ok.size() > 1 ? ok.substr(1) : "host " + std::to_string(h) + " could not map it";
    }
    if (!out.why_not.empty()) {
      out.shm.reset();
      return out;
    }
    out.hierarchical = true;
    if (local == 0) {
      auto g = make_process_group(c10::make_intrusive<c10d::PrefixStore>("hosts", store), static_cast<int>(mine), out.host_count, co);
      if (!g) return make_error("the group of hosts: " + g.message());
      out.hosts = g.value();
    }
  } catch (const std::exception& e) {
    std::string what = e.what();
    return make_error("gradient exchange rendezvous: " + what.substr(0, what.find('\n')));
  }
  return out;
}

// What a hook reaches: the owner while it lives, nothing after.
struct grad_sync::hook_state {
  grad_sync* owner = nullptr;
};

grad_sync::grad_sync(std::vector<torch::Tensor> params, c10::intrusive_ptr<c10d::ProcessGroup> pg, grad_sync_options opts)
    : pg_(std::move(pg)), opts_(opts) {
  if (pg_) {
    world_ = pg_->getSize();
    rank_ = pg_->getRank();
  }
  control_in_.assign(static_cast<size_t>(std::max(0, opts_.control_words)), 0.f);
  if (world_ <= 1) return;  // nothing to synchronise: no buckets, no hooks

  for (auto& p : params)
    if (p.requires_grad()) slots_.push_back(param_slot{p, 0, 0, p.numel(), false});

  // Buckets in reverse parameter order; a bucket holds one dtype and closes
  // at bucket_bytes.
  const int64_t cap = std::max<int64_t>(1, opts_.bucket_bytes);
  int64_t filled = 0;
  for (size_t k = slots_.size(); k-- > 0;) {
    auto& s = slots_[k];
    const bool dtype_change = !buckets_.empty() && slots_[buckets_.back().slots.front()].param.scalar_type() != s.param.scalar_type();
    if (buckets_.empty() || filled >= cap || dtype_change) {
      buckets_.emplace_back();
      filled = 0;
    }
    auto& b = buckets_.back();
    s.bucket = buckets_.size() - 1;
    s.offset = 0;
    for (size_t j : b.slots) s.offset += slots_[j].numel;
    b.slots.push_back(k);
    filled += s.numel * static_cast<int64_t>(s.param.element_size());
  }
  if (buckets_.empty() && opts_.control_words > 0) buckets_.emplace_back();  // no parameters: the control word alone
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    auto& b = buckets_[bi];
    int64_t n = 0;
    for (size_t j : b.slots) n += slots_[j].numel;
    auto o = b.slots.empty() ? torch::TensorOptions(torch::kFloat) : slots_[b.slots.front()].param.options().requires_grad(false);
    if (bi == 0 && opts_.control_words > 0) {
      control_offset_ = n;
      n += opts_.control_words;
      if (o.dtype() != torch::kFloat && o.dtype() != torch::kDouble) o = o.dtype(torch::kFloat);
    }
    b.flat = torch::zeros({n}, o);
    b.pending = static_cast<int>(b.slots.size());
    b.done_ns = std::make_shared<std::atomic<int64_t>>(0);
  }

  int64_t total = 0;
  bool all_float = true;
  for (auto& b : buckets_) {
    b.base = total;
    total += b.flat.numel();
    all_float = all_float && b.flat.scalar_type() == torch::kFloat;
  }
  if (opts_.hierarchical) {
    // Every rank decides alike (same parameters, same capacity): either the
    // whole world goes hierarchical or the whole world uses pg.
    if (all_float && (!opts_.shm || total <= opts_.shm->capacity())) {
      hier_ = true;
      leader_ = !opts_.shm || opts_.shm->rank() == 0;
      hosts_ = opts_.hosts;
      if (opts_.shm && opts_.shm->world() > 1) shm_ = opts_.shm;
      if (leader_ && !hosts_) {
        broken_ = true;
        error_ = "hierarchical gradient exchange: rank " + std::to_string(rank_) + " leads its host but has no group of hosts";
      }
    }
  } else if (opts_.shm && opts_.shm->world() == world_ && opts_.shm->rank() == rank_ && all_float && total <= opts_.shm->capacity()) {
    shm_ = opts_.shm;
  }
  if (shm_)
    for (int p = 0; p < 2; ++p)
      for (int r = 0; r < shm_->world(); ++r) shm_slots_[p].push_back(torch::from_blob(shm_->slot(p, r), {shm_->capacity()}, torch::kFloat));
  // Who sends on the wire: every rank (flat), the host leaders (hierarchical), nobody (one host).
  const bool on_wire = hier_ ? leader_ : !shm_;
  const int wire_world = hier_ ? (hosts_ ? hosts_->getSize() : 0) : world_;
  if (opts_.bf16_wire && on_wire) {
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      auto& b = buckets_[bi];
      if (b.flat.scalar_type() != torch::kFloat) continue;  // other dtypes go as they are
      const int64_t ctrl = bi == 0 ? opts_.control_words : 0;
      b.wire_grads = b.flat.numel() - ctrl;
      if (wire_world >= 3) {
        // Shards of an even number of halves keep every chunk's control words 4-byte aligned.
        b.rs = true;
        b.shard = ((b.wire_grads + wire_world - 1) / wire_world + 1) / 2 * 2;
        b.chunk = b.shard + 2 * ctrl;
        b.wire_in = torch::zeros({wire_world * b.chunk}, torch::kHalf);
        b.rs_out = torch::zeros({wire_world * b.chunk}, torch::kHalf);
        b.rs_mine = torch::zeros({b.shard}, torch::kHalf);
        b.rs_sum = torch::zeros({b.shard}, torch::kFloat);
        for (int r = 0; r < wire_world; ++r) b.wire_all.push_back(torch::zeros({b.shard}, torch::kHalf));
        continue;
      }
      b.wire_ctrl_at = (b.wire_grads + 1) / 2 * 2;
      const int64_t halves = b.wire_ctrl_at + 2 * ctrl;
      b.wire_in = torch::zeros({halves}, torch::kHalf);
      for (int r = 0; r < wire_world; ++r) b.wire_all.push_back(torch::zeros({halves}, torch::kHalf));
    }
  }
  const char* what = hier_ ? (leader_ ? ": exchange across hosts of gradient bucket " : ": result from this host's leader of gradient bucket ")
                     : shm_ ? ": shared-memory reduction of gradient bucket "
                            : ": allreduce of gradient bucket ";
  for (size_t bi = 0; bi < buckets_.size(); ++bi) buckets_[bi].label = "rank " + std::to_string(rank_) + what + std::to_string(bi);

  // A post-hook on each parameter's gradient accumulator runs right after
  // the gradient was added to param.grad() (the mechanism c10d's Reducer uses).
  hooks_ = std::make_shared<hook_state>();
  hooks_->owner = this;
  std::weak_ptr<hook_state> weak = hooks_;
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(slots_[i].param);
    const uintptr_t key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (auto h = weak.lock(); h && h->owner) h->owner->on_grad_ready(i);
          return outputs;
        }));
    hook_keys_.emplace_back(acc, key);
    accumulators_.push_back(std::move(acc));
  }
}

grad_sync::~grad_sync() {
  if (hooks_) hooks_->owner = nullptr;
  for (auto& [acc, key] : hook_keys_) acc->del_post_hook(key);
  // Works still in flight keep their own references to the flat tensors, and
  // the process group (its owner) waits for them when it is destroyed.
}

std::vector<std::vector<size_t>> grad_sync::bucket_layout() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : buckets_) out.push_back(b.slots);
  return out;
}

void grad_sync::arm() {
  if (world_ > 1) armed_ = true;
}

torch::Tensor grad_sync::staging(size_t b) {
  if (!shm_) return buckets_[b].flat;
  return shm_slots_[shm_parity_][static_cast<size_t>(shm_->rank())].narrow(0, buckets_[b].base, buckets_[b].flat.numel());
}

void sum_slots(const torch::Tensor& dst, const std::vector<torch::Tensor>& srcs, std::vector<torch::Tensor>& scratch) {
  torch::NoGradGuard no_grad;
  std::function<void(torch::Tensor, size_t, size_t, size_t)> tree = [&](torch::Tensor out, size_t lo, size_t n, size_t depth) {
    if (n == 1) {
      out.copy_(srcs[lo]);
      return;
    }
    if (n == 2) {
      at::add_out(out, srcs[lo], srcs[lo + 1]);
      return;
    }
    size_t m = 1;
    while (m * 2 < n) m *= 2;
    tree(out, lo, m, depth + 1);
    if (n - m == 1) {
      out.add_(srcs[lo + m]);
      return;
    }
    if (scratch.size() <= depth) scratch.resize(depth + 1);
    if (!scratch[depth].defined() || scratch[depth].numel() < out.numel() || scratch[depth].scalar_type() != out.scalar_type())
      scratch[depth] = torch::empty({out.numel()}, out.options());
    auto tmp = scratch[depth].narrow(0, 0, out.numel());
    tree(tmp, lo + m, n - m, depth + 1);
    out.add_(tmp);
  };
  if (!srcs.empty()) tree(dst, 0, srcs.size(), 0);
}

void grad_sync::reduce_shm(size_t bi) {
  auto& b = buckets_[bi];
  std::vector<torch::Tensor> srcs;
  for (int r = 0; r < shm_->world(); ++r) srcs.push_back(shm_slots_[shm_parity_][static_cast<size_t>(r)].narrow(0, b.base, b.flat.numel()));
  // The same order on every rank: bit-identical sums everywhere.
  sum_slots(b.flat, srcs, scratch_);
  b.done_ns->store(now_ns());
}

void grad_sync::sum_wire(size_t bi) {
  torch::NoGradGuard no_grad;
  auto& b = buckets_[bi];
  auto grads = b.flat.narrow(0, 0, b.wire_grads);
  const int64_t ctrl = b.flat.numel() - b.wire_grads;
  if (b.rs) {
    // The world's rounded shards, end to end (the control words were summed by reduce_shard).
    for (size_t r = 0; r < b.wire_all.size(); ++r) {
      const int64_t from = static_cast<int64_t>(r) * b.shard;
      const int64_t n = std::min(b.shard, b.wire_grads - from);
      if (n <= 0) break;
      grads.narrow(0, from, n).copy_(b.wire_all[r].narrow(0, 0, n).view(torch::kBFloat16));
    }
    return;
  }
  // Rank order on every rank: bit-identical sums everywhere, in fp32.
  for (size_t r = 0; r < b.wire_all.size(); ++r) {
    const auto& m = b.wire_all[r];
    // Mixed-dtype copy_/add_ widen bf16 to fp32 on the fly: no temporary per rank.
    auto g = m.narrow(0, 0, b.wire_grads).view(torch::kBFloat16);
    if (r == 0) grads.copy_(g);
    else grads.add_(g);
    if (ctrl > 0) {
      auto c = m.narrow(0, b.wire_ctrl_at, 2 * ctrl).view(torch::kFloat);
      if (r == 0) b.flat.narrow(0, b.wire_grads, ctrl).copy_(c);
      else b.flat.narrow(0, b.wire_grads, ctrl).add_(c);
    }
  }
}

void grad_sync::reduce_shard(size_t bi) {
  auto& b = buckets_[bi];
  auto& pg = hier_ ? hosts_ : pg_;
  const int64_t ctrl = b.flat.numel() - b.wire_grads;
  {
    torch::NoGradGuard no_grad;
    // Every rank's chunk of this rank's shard, summed in fp32 in rank order,
    // and rounded to bf16 once: the shard everyone receives.
    for (size_t r = 0; r < b.wire_all.size(); ++r) {
      auto m = b.rs_out.narrow(0, static_cast<int64_t>(r) * b.chunk, b.chunk);
      auto g = m.narrow(0, 0, b.shard).view(torch::kBFloat16);
      if (r == 0) b.rs_sum.copy_(g);
      else b.rs_sum.add_(g);
      if (ctrl > 0) {
        // Each chunk carries its sender's control words: every rank sums all of them, exactly.
        auto c = m.narrow(0, b.shard, 2 * ctrl).view(torch::kFloat);
        if (r == 0) b.flat.narrow(0, b.wire_grads, ctrl).copy_(c);
        else b.flat.narrow(0, b.wire_grads, ctrl).add_(c);
      }
    }
    b.rs_mine.view(torch::kBFloat16).copy_(b.rs_sum);
  }
  try {
    std::vector<std::vector<at::Tensor>> out{b.wire_all};
    std::vector<at::Tensor> in{b.rs_mine};
    b.work = pg->allgather(out, in);
    auto done = b.done_ns;
    b.work->getFuture()->addCallback([done](c10::ivalue::Future&) { done->store(now_ns()); });
  } catch (const std::exception& e) {
    fail_step("all-gather of the reduced shards of gradient bucket " + std::to_string(bi) + " could not start: " + first_line(e.what()));
  }
}

void grad_sync::pack(size_t i) {
  auto& s = slots_[i];
  torch::NoGradGuard no_grad;
  auto region = staging(s.bucket).narrow(0, s.offset, s.numel);
  const auto& g = s.param.grad();
  if (g.defined())
    region.view(s.param.sizes()).copy_(g);
  else
    region.zero_();
  s.ready = true;
  --buckets_[s.bucket].pending;
}

void grad_sync::on_grad_ready(size_t i) {
  if (!armed_ || failed_) return;
  if (slots_[i].ready) {
    // A second gradient for the same parameter in one armed step: its bucket
    // may already be on the wire, so this step's result would be wrong.
    misuse_ = true;
    return;
  }
  pack(i);
  if (buckets_[slots_[i].bucket].pending == 0) launch_ready();
}

void grad_sync::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0 && !failed_) launch(next_launch_++);
}

void grad_sync::launch(size_t bi) {
  auto& b = buckets_[bi];
  if (bi == 0 && opts_.control_words > 0) {
    torch::NoGradGuard no_grad;
    auto tail = staging(0).narrow(0, control_offset_, opts_.control_words);
    tail.copy_(torch::tensor(control_in_, torch::kFloat).to(tail.scalar_type()));
  }
  b.done_ns->store(0);
  b.launched_at = clock_type::now();
  if (shm_) shm_->publish(++shm_published_);  // the peers (or the host's leader) sum it
  if (hier_) {
    if (leader_) advance_host(false, {});
    return;
  }
  if (!shm_) send(bi);
}

void grad_sync::fail_step(std::string why) {
  if (failed_) return;
  failed_ = true;
  error_ = std::move(why);
}

void grad_sync::advance_host(bool block, clock_type::time_point deadline) {
  while (host_next_ < next_launch_ && !failed_) {
    const size_t bi = host_next_;
    if (shm_) {
      const uint64_t want = shm_step_base_ + bi + 1;
      if (!block && !shm_->all_published(want)) return;
      if (block)
        if (auto st = shm_->wait_all(want, deadline, opts_.abandon, opts_.spin_wait, buckets_[bi].label); !st) {
          fail_step(st.message());
          return;
        }
      reduce_shm(bi);
    }
    ++host_next_;
    send(bi);
  }
}

void grad_sync::send(size_t bi) {
  auto& b = buckets_[bi];
  auto& pg = hier_ ? hosts_ : pg_;
  b.done_ns->store(0);
  b.launched_at = clock_type::now();
  try {
    if (b.rs) {
      torch::NoGradGuard no_grad;
      const int64_t ctrl = b.flat.numel() - b.wire_grads;
      const int64_t world = static_cast<int64_t>(b.wire_all.size());
      for (int64_t r = 0; r < world; ++r) {
        auto m = b.wire_in.narrow(0, r * b.chunk, b.chunk);
        const int64_t from = r * b.shard, n = std::min(b.shard, b.wire_grads - from);
        if (n > 0) m.narrow(0, 0, n).view(torch::kBFloat16).copy_(b.flat.narrow(0, from, n));  // the padding stays zero
        if (ctrl > 0) m.narrow(0, b.shard, 2 * ctrl).view(torch::kFloat).copy_(b.flat.narrow(0, b.wire_grads, ctrl));
      }
      std::vector<int64_t> equal_splits;  // empty: equal parts
      b.work = pg->alltoall_base(b.rs_out, b.wire_in, equal_splits, equal_splits);
    } else if (b.wire_in.defined()) {
      torch::NoGradGuard no_grad;
      b.wire_in.narrow(0, 0, b.wire_grads).view(torch::kBFloat16).copy_(b.flat.narrow(0, 0, b.wire_grads));
      if (b.flat.numel() > b.wire_grads)
        b.wire_in.narrow(0, b.wire_ctrl_at, 2 * (b.flat.numel() - b.wire_grads)).view(torch::kFloat).copy_(b.flat.narrow(0, b.wire_grads, b.flat.numel() - b.wire_grads));
      std::vector<std::vector<at::Tensor>> out{b.wire_all};
      std::vector<at::Tensor> in{b.wire_in};
      b.work = pg->allgather(out, in);
    } else {
      std::vector<at::Tensor> t{b.flat};
      b.work = pg->allreduce(t);
    }
    auto done = b.done_ns;
    b.work->getFuture()->addCallback([done](c10::ivalue::Future&) { done->store(now_ns()); });
  } catch (const std::exception& e) {
    // Raised on the backward thread inside a hook: keep it for finish().
    fail_step((hier_ ? "exchange across hosts of gradient bucket " : "allreduce of gradient bucket ") + std::to_string(bi) +
              " could not start: " + first_line(e.what()));
  }
}

result<grad_sync_timing> grad_sync::finish() {
  grad_sync_timing t;
  if (world_ <= 1) {
    control_out_ = control_in_;
    return t;
  }
  if (broken_) return make_error(error_ + " (in an earlier step; rebuild the process group and grad_sync)");
  const auto entered = clock_type::now();
  t.buckets = static_cast<int>(buckets_.size());
  t.launched_in_backward = static_cast<int>(next_launch_);

  // Whatever backward did not deliver (unused parameters, a rank with no
  // samples, an unarmed step) goes out now, in bucket order like every rank.
  for (size_t i = 0; i < slots_.size(); ++i)
    if (!slots_[i].ready) pack(i);
  launch_ready();

  torch::Tensor used;
  c10::intrusive_ptr<c10d::Work> used_work;
  if (opts_.find_unused_parameters && !failed_) {
    used = torch::empty({static_cast<int64_t>(slots_.size())}, torch::kFloat);
    float* u = used.data_ptr<float>();
    for (size_t i = 0; i < slots_.size(); ++i) u[i] = slots_[i].param.grad().defined() ? 1.f : 0.f;
    try {
      std::vector<at::Tensor> v{used};
      used_work = pg_->allreduce(v);
    } catch (const std::exception& e) {
      failed_ = true;
      error_ = std::string("allreduce of the used-parameter mask could not start: ") + first_line(e.what());
    }
  }

  const auto deadline = entered + opts_.timeout;
  auto wait_for = [&](const c10::intrusive_ptr<c10d::Work>& w, const std::string& what) {
    if (failed_ || !w) return;
    if (auto st = wait_work(w, deadline, opts_.abandon, what, opts_.spin_wait); !st) {
      failed_ = true;
      error_ = st.message();
    }
  };
  if (hier_ && leader_) advance_host(true, deadline);
  // bf16 reduce-scatter: every bucket's all-to-all was started (in bucket
  // order, like every rank); now each one's shard is summed and its
  // all-gather started, in bucket order again, so the group sees the same
  // sequence of collectives on every rank.
  if (!hier_ || leader_)
    for (size_t bi = 0; bi < buckets_.size() && !failed_; ++bi)
      if (buckets_[bi].rs) {
        wait_for(buckets_[bi].work, buckets_[bi].label);
        if (!failed_) reduce_shard(bi);
      }
  for (size_t bi = 0; bi < buckets_.size() && !failed_; ++bi) {
    auto& b = buckets_[bi];
    if (hier_ && leader_) {
      wait_for(b.work, b.label);
      if (failed_) break;
      if (b.wire_in.defined()) sum_wire(bi);
      if (shm_) {
        // The host's ranks read the result from this rank's slot (nobody
        // else reads it in this mode).
        torch::NoGradGuard no_grad;
        staging(bi).copy_(b.flat);
        shm_->publish_result(shm_step_base_ + bi + 1);
      }
      continue;
    }
    if (hier_) {
      if (auto st = shm_->wait_result(shm_step_base_ + bi + 1, deadline, opts_.abandon, opts_.spin_wait, b.label); !st) {
        fail_step(st.message());
        break;
      }
      torch::NoGradGuard no_grad;
      b.flat.copy_(shm_slots_[shm_parity_][0].narrow(0, b.base, b.flat.numel()));
      b.done_ns->store(now_ns());
      continue;
    }
    if (!shm_) {
      wait_for(b.work, b.label);
      if (!failed_ && b.wire_in.defined()) sum_wire(bi);
      continue;
    }
    if (auto st = shm_->wait_all(shm_step_base_ + bi + 1, deadline, opts_.abandon, opts_.spin_wait, b.label); !st) {
      fail_step(st.message());
      break;
    }
    reduce_shm(bi);
  }
  if (used_work) wait_for(used_work, "rank " + std::to_string(rank_) + ": allreduce of the used-parameter mask");
  const auto waited = clock_type::now();
  if (failed_) {
    // The host's other ranks wait for results that will not come.
    if (hier_ && leader_ && shm_) shm_->fail();
    broken_ = true;
    armed_ = false;
    return make_error(error_);
  }

  // Union of the buckets' in-flight intervals (they may run concurrently on
  // the group's threads); launches are in time order.
  const int64_t waited_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(waited.time_since_epoch()).count();
  int64_t span_end = 0;
  double busy = 0;
  for (auto& b : buckets_) {
    const int64_t start = std::chrono::duration_cast<std::chrono::nanoseconds>(b.launched_at.time_since_epoch()).count();
    int64_t end = b.done_ns->load();
    if (end == 0 || end > waited_ns) end = waited_ns;  // callback not run yet: completion is no later than now
    end = std::max(end, start);
    const int64_t from = std::max(start, span_end);
    if (end > from) busy += static_cast<double>(end - from) * 1e-9;
    span_end = std::max(span_end, end);
  }
  t.allreduce_s = busy;
  t.exposed_s = seconds_between(entered, waited);

  if (opts_.control_words > 0) {
    auto tail = buckets_[0].flat.narrow(0, control_offset_, opts_.control_words).to(torch::kFloat).contiguous();
    control_out_.assign(tail.data_ptr<float>(), tail.data_ptr<float>() + opts_.control_words);
  }
  {
    torch::NoGradGuard no_grad;
    const float* u = used.defined() ? used.data_ptr<float>() : nullptr;
    for (size_t i = 0; i < slots_.size(); ++i) {
      auto& s = slots_[i];
      auto reduced = buckets_[s.bucket].flat.narrow(0, s.offset, s.numel).view(s.param.sizes());
      if (s.param.grad().defined())
        s.param.mutable_grad().copy_(reduced);
      else if (!u || u[i] > 0)
        s.param.mutable_grad() = reduced.clone();
    }
  }

  for (auto& s : slots_) s.ready = false;
  for (auto& b : buckets_) {
    b.pending = static_cast<int>(b.slots.size());
    b.work.reset();
  }
  next_launch_ = 0;
  host_next_ = 0;
  armed_ = false;
  if (shm_) {
    shm_step_base_ = shm_published_;
    shm_parity_ ^= 1;
  }
  if (misuse_) {
    misuse_ = false;
    return make_error("a parameter received a second gradient after its bucket was sent: call arm() right before the step's last backward only");
  }
  return t;
}

}  // namespace dtactor
