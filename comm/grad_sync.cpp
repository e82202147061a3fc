#include "comm/grad_sync.hpp"

#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace dtactor {

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_between(clock_type::time_point a, clock_type::time_point b) { return std::chrono::duration<double>(b - a).count(); }

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

constexpr int64_t control_words = step_control::words;

// Buckets in reverse parameter order; a bucket holds one dtype and closes
// at bucket_bytes. Each bucket: indices into `params`, in filling order.
std::vector<std::vector<size_t>> cut_buckets(const std::vector<torch::Tensor>& params, int64_t bucket_bytes) {
  const int64_t cap = std::max<int64_t>(1, bucket_bytes);
  std::vector<std::vector<size_t>> out;
  int64_t filled = 0;
  for (size_t k = params.size(); k-- > 0;) {
    const bool dtype_change = !out.empty() && params[out.back().front()].scalar_type() != params[k].scalar_type();
    if (out.empty() || filled >= cap || dtype_change) {
      out.emplace_back();
      filled = 0;
    }
    out.back().push_back(k);
    filled += params[k].numel() * static_cast<int64_t>(params[k].element_size());
  }
  return out;
}

// A bucket's flat tensor: its gradients' elements, and the control words
// after them in the last bucket, the one launched when backward ends
// (carried in float when the gradients are not floating point).
struct bucket_shape {
  int64_t grads = 0, numel = 0;
  torch::TensorOptions options;
};
bucket_shape shape_of(const std::vector<torch::Tensor>& params, const std::vector<size_t>& members, bool last, bool carry_control) {
  bucket_shape b;
  for (size_t j : members) b.grads += params[j].numel();
  b.numel = b.grads;
  b.options = members.empty() ? torch::TensorOptions(torch::kFloat) : params[members.front()].options().requires_grad(false);
  // bf16 (or fp16) gradients (train.precision = bf16) are summed in float32:
  // Gloo reduces neither, and the sum keeps float32's precision.
  if (b.options.dtype() == torch::kBFloat16 || b.options.dtype() == torch::kHalf) b.options = b.options.dtype(torch::kFloat);
  if (last && carry_control) {
    b.numel += control_words;
    if (b.options.dtype() != torch::kFloat && b.options.dtype() != torch::kDouble) b.options = b.options.dtype(torch::kFloat);
  }
  return b;
}

std::vector<torch::Tensor> with_grads(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params)
    if (p.requires_grad()) out.push_back(p);
  return out;
}

// The buckets of a reducer over `params` (those requiring grad).
std::vector<bucket_shape> bucket_shapes(const std::vector<torch::Tensor>& params, int64_t bucket_bytes, bool carry_control) {
  auto cuts = cut_buckets(params, bucket_bytes);
  if (cuts.empty() && carry_control) cuts.emplace_back();  // no parameters: the control alone
  std::vector<bucket_shape> out;
  for (size_t bi = 0; bi < cuts.size(); ++bi) out.push_back(shape_of(params, cuts[bi], bi + 1 == cuts.size(), carry_control));
  return out;
}

}  // namespace

std::vector<torch::Tensor> bucket_buffers_for(const std::vector<torch::Tensor>& params, const grad_sync_options& o) {
  std::vector<torch::Tensor> out;
  for (const auto& b : bucket_shapes(with_grads(params), o.bucket_bytes, o.carry_control)) out.push_back(torch::zeros({b.numel}, b.options));
  return out;
}

// What a hook reaches: the owner while it lives, nothing after.
struct grad_sync::hook_state {
  grad_sync* owner = nullptr;
};

grad_sync::grad_sync(std::vector<torch::Tensor> params, c10::intrusive_ptr<c10d::ProcessGroup> pg, grad_sync_options opts)
    : pg_(std::move(pg)), opts_(opts) {
  if (opts_.exchange.transport == exchange_transport::host) {
    // This host's ranks alone, through their segment (no process group).
    if (opts_.shm) {
      world_ = opts_.shm->world();
      rank_ = opts_.shm->rank();
    }
  } else if (pg_) {
    world_ = pg_->getSize();
    rank_ = pg_->getRank();
  }
  if (world_ <= 1) return;  // nothing to synchronise: no buckets, no hooks

  for (auto& p : params)
    if (p.requires_grad()) slots_.push_back(param_slot{p, 0, 0, p.numel(), false});
  assign_buckets();
  allocate_buckets();
  if (opts_.zero2) {
    plan_zero2();
    if (broken_) return;
  }
  if (!open_exchange()) return;
  // zero2: a bucket's buffer exists only from its first gradient to its delivery.
  if (opts_.zero2)
    for (auto& b : buckets_) b.flat = torch::Tensor();
  install_hooks();
}

void grad_sync::assign_buckets() {
  std::vector<torch::Tensor> params;
  for (const auto& s : slots_) params.push_back(s.param);
  for (const auto& members : cut_buckets(params, opts_.bucket_bytes)) {
    auto& f = fills_.emplace_back();
    int64_t offset = 0;
    for (size_t k : members) {
      slots_[k].bucket = fills_.size() - 1;
      slots_[k].offset = offset;
      offset += slots_[k].numel;
      f.slots.push_back(k);
    }
  }
  if (fills_.empty() && opts_.carry_control) fills_.emplace_back();  // no parameters: the control alone
}

void grad_sync::allocate_buckets() {
  std::vector<torch::Tensor> params;
  for (const auto& s : slots_) params.push_back(s.param);
  buckets_.resize(fills_.size());
  control_bucket_ = fills_.empty() ? 0 : fills_.size() - 1;
  for (size_t bi = 0; bi < fills_.size(); ++bi) {
    auto& f = fills_[bi];
    auto& b = buckets_[bi];
    const bucket_shape shape = shape_of(params, f.slots, bi == control_bucket_, opts_.carry_control);
    b.grads = shape.grads;
    if (bi == control_bucket_ && opts_.carry_control) control_offset_ = shape.grads;
    // zero2's buffers live only while their bucket is in flight.
    if (opts_.recycled && !opts_.zero2) b.flat = opts_.recycled->take(shape.numel, shape.options);
    if (b.flat.defined())
      reused_bytes_ += shape.numel * static_cast<int64_t>(b.flat.element_size());
    else if (opts_.zero2)
      // Only its shape and dtype are read before it is dropped (below):
      // never written, its pages never become resident (torch::zeros
      // would touch 4 bytes a parameter at every generation's start).
      b.flat = torch::empty({shape.numel}, shape.options);
    else
      b.flat = torch::zeros({shape.numel}, shape.options);
    b.numel = shape.numel;
    f.options = shape.options;
    f.pending = static_cast<int>(f.slots.size());
  }
}

bool grad_sync::open_exchange() {
  exchange_groups groups;
  groups.pg = pg_;
  groups.shm = opts_.shm;
  groups.hosts = opts_.hosts;
  groups.zero2 = static_cast<bool>(opts_.zero2);
  auto ex = make_exchange(buckets_, opts_.exchange, groups, exchange_waits{opts_.abandon, opts_.spin_wait, opts_.timeout});
  if (!ex) {
    broken_ = true;
    error_ = ex.message();
    return false;
  }
  exchange_ = std::move(ex.value());
  for (size_t bi = 0; bi < buckets_.size(); ++bi) buckets_[bi].label = "rank " + std::to_string(rank_) + exchange_->label_stem() + std::to_string(bi);
  return true;
}

void grad_sync::install_hooks() {
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
  // The next reducer takes them (bucket_buffers::take leaves one that a
  // collective still in flight references).
  exchange_.reset();
  if (opts_.recycled && !opts_.zero2)
    for (auto& b : buckets_) opts_.recycled->give(std::move(b.flat));
  // Works still in flight keep their own references to the flat tensors, and
  // the process group (its owner) waits for them when it is destroyed.
}

// Which pieces of each bucket every rank keeps: each parameter's elements
// (at param_index in the index space) cut by every rank's held ranges.
void grad_sync::plan_zero2() {
  const auto& z = *opts_.zero2;
  if (z.param_index.size() != slots_.size() || z.held.size() != static_cast<size_t>(world_)) {
    broken_ = true;
    error_ = "train.zero=2: the gradient shards do not fit this model or world (" + std::to_string(z.param_index.size()) + " parameters, " +
             std::to_string(slots_.size()) + " with gradients; " + std::to_string(z.held.size()) + " ranks, world " + std::to_string(world_) + ")";
    return;
  }
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    auto& b = buckets_[bi];
    b.kept_by.assign(static_cast<size_t>(world_), {});
    for (size_t k : fills_[bi].slots) {
      const auto& s = slots_[k];
      const int64_t at = z.param_index[k];
      for (int r = 0; r < world_; ++r)
        for (const auto& [a, e] : z.held[static_cast<size_t>(r)]) {
          const int64_t lo = std::max(a, at), hi = std::min(e, at + s.numel);
          if (lo >= hi) continue;
          const int64_t off = s.offset + (lo - at), len = hi - lo;
          auto& pieces = b.kept_by[static_cast<size_t>(r)];
          pieces.emplace_back(off, len);
          if (r == rank_) fills_[bi].mine.push_back(kept_piece{off, len, lo});
        }
    }
    // The transports want them ascending and as few as possible.
    for (auto& pieces : b.kept_by) {
      std::sort(pieces.begin(), pieces.end());
      std::vector<std::pair<int64_t, int64_t>> merged;
      for (const auto& p : pieces) {
        if (!merged.empty() && merged.back().first + merged.back().second == p.first)
          merged.back().second += p.second;
        else
          merged.push_back(p);
      }
      pieces = std::move(merged);
    }
  }
}

void grad_sync::ensure_flat(size_t bi) {
  auto& b = buckets_[bi];
  if (!b.flat.defined()) b.flat = torch::empty({b.numel}, fills_[bi].options);
}

void grad_sync::take(size_t bi) {
  auto& b = buckets_[bi];
  if (bi == control_bucket_ && opts_.carry_control) {
    auto tail = b.flat.narrow(0, control_offset_, control_words).to(torch::kFloat).contiguous();
    std::memcpy(static_cast<void*>(&control_out_), tail.data_ptr<float>(), sizeof(control_out_));
  }
  if (!opts_.zero2) return;
  try {
    torch::NoGradGuard no_grad;
    for (const auto& p : fills_[bi].mine) opts_.zero2->deliver(p.index, b.flat.narrow(0, p.offset, p.length));
  } catch (const std::exception& e) {
    fail_step("rank " + std::to_string(rank_) + ": delivering gradient bucket " + std::to_string(bi) + ": " + first_line(e.what()));
  }
  inflight_bytes_ -= b.numel * static_cast<int64_t>(b.flat.element_size());
  b.flat = torch::Tensor();
}

int64_t grad_sync::buffer_bytes() const {
  int64_t n = 0;
  for (const auto& b : buckets_)
    if (b.flat.defined()) n += b.flat.numel() * static_cast<int64_t>(b.flat.element_size());
  return n;
}

std::vector<std::vector<size_t>> grad_sync::bucket_layout() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& f : fills_) out.push_back(f.slots);
  return out;
}

void grad_sync::arm() {
  if (world_ > 1 && exchange_) armed_ = true;
}

void grad_sync::pack(size_t i) {
  auto& s = slots_[i];
  torch::NoGradGuard no_grad;
  if (opts_.zero2) ensure_flat(s.bucket);
  auto region = exchange_->staging(s.bucket).narrow(0, s.offset, s.numel);
  const auto& g = s.param.grad();
  s.used = g.defined();
  if (g.defined())
    region.view(s.param.sizes()).copy_(g);
  else
    region.zero_();
  // zero2: the bucket has it; the optimizer gets this rank's share of the sum.
  if (opts_.zero2) s.param.mutable_grad().reset();
  s.ready = true;
  --fills_[s.bucket].pending;
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
  if (fills_[slots_[i].bucket].pending == 0) launch_ready();
}

void grad_sync::launch_ready() {
  while (next_launch_ < buckets_.size() && fills_[next_launch_].pending == 0 && !failed_) launch(next_launch_++);
}

void grad_sync::launch(size_t bi) {
  if (opts_.zero2) ensure_flat(bi);
  if (bi == control_bucket_ && opts_.carry_control) {
    torch::NoGradGuard no_grad;
    if (control_source_) control_in_ = control_source_();
    float words[control_words];
    std::memcpy(words, &control_in_, sizeof(words));
    auto tail = exchange_->staging(bi).narrow(0, control_offset_, control_words);
    tail.copy_(torch::from_blob(words, {control_words}, torch::kFloat).to(tail.scalar_type()));
  }
  if (auto st = exchange_->start(bi); !st) {
    fail_step(st.message());
    return;
  }
  if (!opts_.zero2) return;
  // Bounded buffers: the oldest launched buckets are waited for and
  // delivered while backward goes on, keeping the newest in flight.
  inflight_bytes_ += buckets_[bi].numel * static_cast<int64_t>(buckets_[bi].flat.element_size());
  const int64_t bound = opts_.zero2->inflight_bytes;
  while (bound > 0 && inflight_bytes_ > bound && exchange_->waits_early() && next_wait_ < bi && !failed_) {
    if (auto st = exchange_->wait(next_wait_, clock_type::now() + opts_.timeout); !st) {
      fail_step(st.message());
      return;
    }
    take(next_wait_++);
  }
}

void grad_sync::fail_step(std::string why) {
  if (failed_) return;
  failed_ = true;
  error_ = std::move(why);
}

void grad_sync::launch_all() {
  if (world_ <= 1 || broken_ || !exchange_) return;
  for (size_t i = 0; i < slots_.size(); ++i)
    if (!slots_[i].ready) pack(i);
  launch_ready();
}

result<grad_sync_timing> grad_sync::finish() {
  grad_sync_timing t;
  if (world_ <= 1) {
    if (control_source_) control_in_ = control_source_();
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
  c10::intrusive_ptr<c10d::Work> used_work = start_used_mask(used);
  wait_step(used_work, entered + opts_.timeout);
  const auto waited = clock_type::now();
  if (failed_) {
    exchange_->abort();
    broken_ = true;
    armed_ = false;
    if (opts_.zero2)
      for (auto& b : buckets_) b.flat = torch::Tensor();
    return make_error(error_);
  }
  t.allreduce_s = busy_seconds(waited);
  t.exposed_s = seconds_between(entered, waited);
  if (!opts_.zero2) write_grads(used);
  end_step();
  if (misuse_) {
    misuse_ = false;
    return make_error("a parameter received a second gradient after its bucket was sent: call arm() right before the step's last backward only");
  }
  return t;
}

c10::intrusive_ptr<c10d::Work> grad_sync::start_used_mask(torch::Tensor& used) {
  if (!opts_.find_unused_parameters || failed_) return {};
  used = torch::empty({static_cast<int64_t>(slots_.size())}, torch::kFloat);
  float* u = used.data_ptr<float>();
  for (size_t i = 0; i < slots_.size(); ++i) u[i] = slots_[i].used ? 1.f : 0.f;
  try {
    std::vector<at::Tensor> v{used};
    return pg_->allreduce(v);
  } catch (const std::exception& e) {
    fail_step(std::string("allreduce of the used-parameter mask could not start: ") + first_line(e.what()));
  }
  return {};
}

void grad_sync::wait_step(const c10::intrusive_ptr<c10d::Work>& used_work, std::chrono::steady_clock::time_point deadline) {
  if (!failed_)
    if (auto st = exchange_->flush(deadline); !st) fail_step(st.message());
  for (size_t bi = next_wait_; bi < buckets_.size() && !failed_; ++bi)
    if (auto st = exchange_->wait(bi, deadline); !st) fail_step(st.message());
  if (used_work && !failed_)
    if (auto st = wait_work(used_work, deadline, opts_.abandon, "rank " + std::to_string(rank_) + ": allreduce of the used-parameter mask",
                            opts_.spin_wait);
        !st)
      fail_step(st.message());
  for (size_t bi = next_wait_; bi < buckets_.size() && !failed_; ++bi) take(bi);
}

double grad_sync::busy_seconds(std::chrono::steady_clock::time_point waited) const {
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
  return busy;
}

void grad_sync::write_grads(const torch::Tensor& used) {
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

void grad_sync::end_step() {
  for (auto& s : slots_) s.ready = false;
  for (auto& f : fills_) f.pending = static_cast<int>(f.slots.size());
  next_launch_ = 0;
  next_wait_ = 0;
  inflight_bytes_ = 0;
  armed_ = false;
  exchange_->end_step();
}

}  // namespace dtactor
