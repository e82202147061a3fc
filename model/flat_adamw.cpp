#include "model/flat_adamw.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "model/adamw_kernel.hpp"
#include "model/layers.hpp"

namespace dtactor {

namespace {
// Moments never written yet are zeros that take no memory (a stride-0 view
// of one element): a fresh optimizer that is sharded before its first step
// never allocates the moments it gives away.
torch::Tensor lazy_zeros(int64_t n, const torch::TensorOptions& o) { return n > 1 ? torch::zeros({1}, o).expand({n}) : torch::zeros({n}, o); }
// A dense CPU buffer of zeros whose pages are the kernel's until written
// (an anonymous mapping; torch::zeros writes every byte at once): the full
// gradient buffers of a `train.zero = 2` rank, dropped before any backward
// writes them, never become resident (4 bytes a parameter less at set-up).
torch::Tensor untouched_zeros(int64_t n, const torch::TensorOptions& o) {
  const size_t bytes = static_cast<size_t>(n) * o.dtype().itemsize();
  if (!o.device().is_cpu() || bytes < (size_t{1} << 20)) return torch::zeros({n}, o);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return torch::zeros({n}, o);
  return torch::from_blob(p, {n}, [bytes](void* q) { ::munmap(q, bytes); }, o);
}
bool is_lazy(const torch::Tensor& t) { return t.defined() && t.numel() > 1 && t.stride(0) == 0; }
torch::Tensor dense_of(const torch::Tensor& t) { return is_lazy(t) ? torch::zeros({t.numel()}, t.options()) : t; }
}  // namespace

void flat_adamw::materialize() {
  for (auto& g : groups_)
    for (auto& w : g.windows) {
      w.exp_avg = dense_of(w.exp_avg);
      w.exp_avg_sq = dense_of(w.exp_avg_sq);
    }
}

flat_adamw::flat_adamw(std::vector<torch::Tensor> params, const flat_adamw_options& o) : opts_(o) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> filled;  // per group
  for (auto& p : params) {
    if (!p.requires_grad()) continue;
    const bool decay = p.dim() >= 2;
    (decay ? decay_order_ : no_decay_order_).push_back(p);
    size_t g = 0;
    while (g < groups_.size() && !(groups_[g].decay == decay && groups_[g].params.scalar_type() == p.scalar_type())) ++g;
    if (g == groups_.size()) {
      group gr;
      gr.decay = decay;
      gr.params = torch::empty({0}, p.options().requires_grad(false));
      groups_.push_back(std::move(gr));
      filled.push_back(0);
    }
    slots_.push_back(slot{p, g, filled[g], p.numel(), {}, {}, {}, {}});
    filled[g] += p.numel();
  }
  // Parameters built without values (model/layers: defer_block_values)
  // keep pages nobody touched, zeros until their values are written.
  const bool deferred = std::any_of(slots_.begin(), slots_.end(), [](const slot& s) { return awaits_initial_values(s.param); });
  int64_t base = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto& gr = groups_[g];
    const auto opts = gr.params.options();
    gr.base = base;
    base += filled[g];
    gr.params = deferred ? untouched_zeros(filled[g], opts) : torch::empty({filled[g]}, opts);
    gr.grads = untouched_zeros(filled[g], opts);
    gr.windows.push_back(window{0, lazy_zeros(filled[g], opts), lazy_zeros(filled[g], opts), torch::Tensor()});
  }
  for (auto& s : slots_) {
    s.param_view = view(groups_[s.group].params, s);
    s.grad_view = view(groups_[s.group].grads, s);
  }
  rebind();
  for (auto& s : slots_) s.param.mutable_grad() = s.grad_view;
  if (o.compute != torch::kFloat) attach_compute_copies(deferred);
}

// Built deferred, the copies take pages only where values are written
// (the parameters of no unit now, a rank's shards and the units it gathers
// later), as the masters do.
void flat_adamw::attach_compute_copies(bool deferred) {
  torch::NoGradGuard no_grad;
  for (auto& g : groups_) {
    TORCH_CHECK(g.params.scalar_type() == torch::kFloat, "mixed precision needs float32 parameters to keep as masters");
    const auto o = g.params.options().dtype(opts_.compute);
    const int64_t n = g.params.numel();
    g.compute = deferred ? untouched_zeros(n, o) : torch::empty({n}, o);
    g.compute_grads = untouched_zeros(n, o);
  }
  for (auto& s : slots_) {
    const bool awaits = awaits_initial_values(s.param);
    s.compute_view = view(groups_[s.group].compute, s);
    s.compute_grad_view = view(groups_[s.group].compute_grads, s);
    s.param.set_data(s.compute_view);
    s.param.mutable_grad() = s.compute_grad_view;
    if (!awaits) s.compute_view.copy_(s.param_view);
  }
  mixed_ = true;
  grads_converted_ = false;
}

void flat_adamw::refresh_compute() {
  if (!mixed_) return;
  torch::NoGradGuard no_grad;
  if (std::exchange(keep_compute_once_, false)) {
    grads_converted_ = false;
    return;
  }
  if (opts_.held_masters_only) {
    if (gatherers_rounding_ > 0) {
      grads_converted_ = false;
      return;
    }
    for (auto& g : groups_)
      for (const auto& w : g.windows) g.compute.narrow(0, w.begin, w.exp_avg.numel()).copy_(g.params.narrow(0, w.begin, w.exp_avg.numel()));
  } else {
    for (auto& g : groups_) g.compute.copy_(g.params);
  }
  grads_converted_ = false;
}

void flat_adamw::round_into_compute(int64_t begin, int64_t end) {
  if (!mixed_) return;
  torch::NoGradGuard no_grad;
  auto masters = param_views(begin, end), copies = compute_views(begin, end);
  for (size_t i = 0; i < masters.size(); ++i) copies[i].copy_(masters[i]);
}

std::vector<torch::Tensor> flat_adamw::compute_views(int64_t begin, int64_t end) const {
  std::vector<torch::Tensor> out;
  if (!mixed_) return out;
  for (const auto& g : groups_) {
    const int64_t lo = std::max<int64_t>(begin - g.base, 0), hi = std::min<int64_t>(end - g.base, g.params.numel());
    if (lo < hi) out.push_back(g.compute.narrow(0, lo, hi - lo));
  }
  return out;
}

torch::Tensor flat_adamw::master_of(const torch::Tensor& p) const {
  for (const auto& s : slots_)
    if (s.param.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return s.param_view;
  return {};
}

void flat_adamw::rebind() {
  torch::NoGradGuard no_grad;
  for (auto& s : slots_) {
    const auto& target = mixed_ ? s.compute_view : s.param_view;
    if (s.param.data_ptr() == target.data_ptr()) continue;
    if (!awaits_initial_values(s.param)) s.param_view.copy_(s.param.detach());
    s.param.set_data(target);
  }
  refresh_compute();
}

// Every parameter's grad into its view of the full buffers (bf16's in
// mixed precision). Pointer checks only (no tensor ops) when every gradient
// is still its view.
void flat_adamw::adopt_param_grads() {
  for (auto& s : slots_) {
    const auto& target = mixed_ ? s.compute_grad_view : s.grad_view;
    const auto& g = s.param.grad();
    if (g.defined() && g.data_ptr() == target.data_ptr()) continue;
    if (g.defined())
      target.copy_(g);
    else
      target.zero_();
    s.param.mutable_grad() = target;
  }
}

void flat_adamw::gather_grads() {
  torch::NoGradGuard no_grad;
  if (grads_sharded_) {
    // Whatever autograd left in a parameter's grad (a world of one: no
    // reducer took it) goes into the held windows; the rest is not ours.
    for (auto& s : slots_) {
      const auto& gr = s.param.grad();
      if (!gr.defined()) continue;
      auto flat = gr.reshape({-1});
      auto& g = groups_[s.group];
      for (auto& w : g.windows) {
        const int64_t lo = std::max(s.offset, w.begin), hi = std::min(s.offset + s.numel, w.begin + w.grad.numel());
        if (lo < hi) w.grad.narrow(0, lo - w.begin, hi - lo).copy_(flat.narrow(0, lo - s.offset, hi - lo));
      }
      s.param.mutable_grad().reset();
    }
    return;
  }
  adopt_param_grads();
  // Mixed precision: the step's bf16 gradients, once, as float32 (clipping
  // then scales the float32 ones); sharded, only the held windows'.
  if (mixed_ && !grads_converted_) {
    for (auto& g : groups_) {
      if (!fp32_grads_windowed()) {
        g.grads.copy_(g.compute_grads);
        continue;
      }
      for (auto& w : g.windows) w.grad.copy_(g.compute_grads.narrow(0, w.begin, w.exp_avg.numel()));
    }
    grads_converted_ = true;
  }
}

double flat_adamw::clip_grad_norm(double max_norm) {
  gather_grads();
  if (groups_.empty()) return 0;
  const auto ranges = norm_ranges();
  const double n = norm_of_parts(grad_range_squares(ranges, 0, ranges.size()));
  clip_to(n, max_norm);
  return n;
}

void flat_adamw::clip_to(double norm, double max_norm) {
  if (!std::isfinite(max_norm)) return;
  torch::NoGradGuard no_grad;
  // As clip_grad_norm_: scale by min(1, max_norm / (norm + 1e-6)).
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1.0) return;
  for (auto& g : groups_) {
    if (!fp32_grads_windowed()) {
      g.grads.mul_(coef);
      continue;
    }
    for (auto& w : g.windows) w.grad.mul_(coef);
  }
}

index_ranges flat_adamw::norm_ranges() const { return dtactor::norm_ranges(total_elements(), group_bases()); }

namespace {
// Sum of squares of a 1-D float32, float64 or bf16 buffer's n elements from `offset`.
double squares_at(const torch::Tensor& buffer, int64_t offset, int64_t n) {
  switch (buffer.scalar_type()) {
    case torch::kFloat:
      return sum_squares(buffer.data_ptr<float>() + offset, n);
    case torch::kBFloat16:
      return sum_squares_bf16(reinterpret_cast<const uint16_t*>(buffer.data_ptr<c10::BFloat16>() + offset), n);
    default:
      return sum_squares(buffer.data_ptr<double>() + offset, n);
  }
}
}  // namespace

flat_adamw::held_span flat_adamw::held_grads(int64_t begin, int64_t end) const {
  for (const auto& g : groups_) {
    if (begin < g.base || end > g.base + g.params.numel()) continue;
    if (!fp32_grads_windowed()) return {&g.grads, begin - g.base};
    // The whole bf16 gradient, whose values the float32 windows widen: the
    // same norm as theirs would give.
    if (!grads_sharded_) return {&g.compute_grads, begin - g.base};
    for (const auto& w : g.windows) {
      const int64_t lo = begin - g.base - w.begin;
      if (lo >= 0 && end - g.base <= w.begin + w.exp_avg.numel()) return {&w.grad, lo};
    }
  }
  TORCH_CHECK(false, "gradients of elements [", begin, ", ", end, ") are not held here");
}

std::vector<double> flat_adamw::grad_range_squares(const index_ranges& ranges, size_t first, size_t last) {
  gather_grads();
  torch::NoGradGuard no_grad;
  std::vector<double> out(last - first, 0.0);
  // Float32, float64 and bf16 buffers are read in place through their
  // pointers: a tensor a range (up to max_norm_chunks of them) cost more
  // than the sums. Other dtypes go through a double copy of the range (the
  // same values, so the same bits).
  std::vector<held_span> spans;
  std::vector<torch::Tensor> copies(last - first);
  for (size_t i = first; i < last; ++i) {
    auto h = held_grads(ranges[i].first, ranges[i].second);
    const auto type = h.buffer->scalar_type();
    if ((type != torch::kFloat && type != torch::kDouble && type != torch::kBFloat16) || !h.buffer->is_contiguous()) {
      copies[i - first] = h.buffer->narrow(0, h.offset, ranges[i].second - ranges[i].first).to(torch::kDouble).contiguous();
      h = {&copies[i - first], 0};
    }
    spans.push_back(h);
  }
  // One range a task: each range's sum is one serial loop whatever the
  // thread count.
  at::parallel_for(0, static_cast<int64_t>(spans.size()), 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const auto& h = spans[static_cast<size_t>(i)];
      const auto& r = ranges[first + static_cast<size_t>(i)];
      const int64_t n = r.second - r.first;
      out[static_cast<size_t>(i)] = squares_at(*h.buffer, h.offset, n);
    }
  });
  return out;
}

void flat_adamw::shard_grads() {
  torch::NoGradGuard no_grad;
  if (grads_sharded_) return;
  adopt_param_grads();  // whatever is in the full buffers now
  // Mixed precision: the step's gradients are still bf16 unless a clip
  // already converted them. Converting the whole buffer here made 4 bytes
  // a parameter resident on every rank at set-up; each window converts its
  // own nonzero chunks instead.
  const bool from_compute = mixed_ && !grads_converted_;
  // Windows of float32 gradients already (mixed, sharded), holding the
  // step's converted ones: kept.
  const bool keep_windows = fp32_grads_windowed() && grads_converted_;
  grads_sharded_ = true;
  for (auto& g : groups_) {
    // Pages of the window only where the full buffer has a nonzero value
    // (between steps it has none): a fresh rank's first window is the whole
    // model, and copying its zeros made 4 bytes a parameter resident at
    // set-up for nothing (shard() replaces the window at once).
    const auto& full = from_compute ? g.compute_grads : g.grads;
    for (auto& w : g.windows) {
      if (keep_windows) continue;
      const int64_t n = w.exp_avg.numel();
      w.grad = untouched_zeros(n, g.params.options());
      if (grads_unwritten_) continue;  // zeros, and none of their pages read
      constexpr int64_t chunk = int64_t{1} << 20;
      for (int64_t at = 0; at < n; at += chunk) {
        auto src = full.narrow(0, w.begin + at, std::min(chunk, n - at));
        if (src.ne(0).any().item<bool>()) w.grad.narrow(0, at, src.numel()).copy_(src);
      }
    }
    g.grads = torch::empty({0}, g.params.options());
    if (mixed_) g.compute_grads = torch::empty({0}, g.compute.options());
  }
  for (auto& s : slots_) {
    s.grad_view = torch::Tensor();
    s.compute_grad_view = torch::Tensor();
    s.param.mutable_grad().reset();
  }
}

torch::Tensor flat_adamw::grad_window(int64_t begin, int64_t end) const {
  for (const auto& g : groups_) {
    if (begin < g.base || end > g.base + g.params.numel()) continue;
    for (const auto& w : g.windows) {
      const int64_t lo = begin - g.base - w.begin;
      if (lo < 0 || end - g.base > w.begin + w.exp_avg.numel()) continue;
      return grads_of(g, w).narrow(0, lo, end - begin);
    }
  }
  TORCH_CHECK(false, "gradients of elements [", begin, ", ", end, ") are not held here");
}

std::vector<int64_t> flat_adamw::param_index() const {
  std::vector<int64_t> out;
  for (const auto& s : slots_) out.push_back(groups_[s.group].base + s.offset);
  return out;
}

std::optional<std::pair<int64_t, int64_t>> flat_adamw::range_of(const torch::Tensor& p) const {
  for (const auto& s : slots_)
    if (s.param.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) {
      const int64_t first = groups_[s.group].base + s.offset;
      return std::make_pair(first, first + s.numel);
    }
  return std::nullopt;
}

std::optional<int64_t> flat_adamw::index_at(const void* data) const {
  const auto at = reinterpret_cast<uintptr_t>(data);
  for (const auto& g : groups_) {
    const auto first = reinterpret_cast<uintptr_t>(g.params.data_ptr());
    const auto bytes = static_cast<uintptr_t>(g.params.numel() * g.params.element_size());
    if (at >= first && at < first + bytes) return g.base + static_cast<int64_t>((at - first) / static_cast<uintptr_t>(g.params.element_size()));
  }
  return std::nullopt;
}

void flat_adamw::step() {
  gather_grads();
  materialize();
  torch::NoGradGuard no_grad;
  ++step_;
  const double bc1 = 1 - std::pow(opts_.beta1, static_cast<double>(step_));
  const double bc2 = 1 - std::pow(opts_.beta2, static_cast<double>(step_));
  const double step_size = opts_.lr / bc1;
  for (auto& g : groups_) {
    const double wd = g.decay ? opts_.weight_decay : 0.0;
    for (auto& w : g.windows) {
      const int64_t n = w.exp_avg.numel();
      if (n == 0) continue;
      auto params = g.params.narrow(0, w.begin, n), grads = grads_of(g, w);
      if (params.scalar_type() == torch::kFloat && params.is_cpu()) {
        adamw_scalars k;
        k.decay_factor = static_cast<float>(1 - opts_.lr * wd);
        k.beta1 = static_cast<float>(opts_.beta1);
        k.one_minus_beta1 = static_cast<float>(1 - opts_.beta1);
        k.beta2 = static_cast<float>(opts_.beta2);
        k.one_minus_beta2 = static_cast<float>(1 - opts_.beta2);
        k.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bc2));
        k.eps = static_cast<float>(opts_.eps);
        k.neg_step_size = static_cast<float>(-step_size);
        adamw_update(params.data_ptr<float>(), w.exp_avg.data_ptr<float>(), w.exp_avg_sq.data_ptr<float>(), grads.data_ptr<float>(), n, k);
        continue;
      }
      // Other dtypes and devices: the same arithmetic as tensor ops.
      if (wd != 0) params.mul_(1 - opts_.lr * wd);
      w.exp_avg.mul_(opts_.beta1).add_(grads, 1 - opts_.beta1);
      w.exp_avg_sq.mul_(opts_.beta2).addcmul_(grads, grads, 1 - opts_.beta2);
      auto denom = (w.exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(opts_.eps);
      params.addcdiv_(w.exp_avg, denom, -step_size);
    }
  }
}

void flat_adamw::zero_grad() {
  torch::NoGradGuard no_grad;
  // Mixed precision with whole bf16 gradients (zero 0 and 1): the float32
  // ones are only ever the next conversion of the bf16 ones, so they are
  // marked stale rather than converted and zeroed (a pass over 4 bytes a
  // parameter held, every step, for nothing).
  if (mixed_ && !grads_sharded_) {
    adopt_param_grads();  // every parameter's grad a view of the bf16 buffer again
    for (auto& g : groups_) g.compute_grads.zero_();
    grads_converted_ = false;
    return;
  }
  gather_grads();
  for (auto& g : groups_) {
    if (!fp32_grads_windowed()) {
      g.grads.zero_();
      continue;
    }
    for (auto& w : g.windows) w.grad.zero_();
  }
}

std::vector<state_tensor> flat_adamw::state_tensors() const {
  // Live tensors, which a load writes into: lazy zeros become real here.
  const_cast<flat_adamw*>(this)->materialize();
  std::vector<state_tensor> out;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const auto& gr = groups_[g];
    for (int which = 0; which < 2; ++which) {
      const std::string name = (which == 0 ? "optim/exp_avg." : "optim/exp_avg_sq.") + std::to_string(g);
      if (!sharded_) {
        out.push_back(state_tensor::whole(name, which == 0 ? gr.windows[0].exp_avg : gr.windows[0].exp_avg_sq));
        continue;
      }
      auto add = [&](int64_t first, const torch::Tensor& t) {
        state_tensor st;
        st.name = name;
        st.t = t;
        st.shape = {gr.params.numel()};
        st.first = first;
        st.sharded = true;
        out.push_back(std::move(st));
      };
      for (const auto& w : gr.windows) add(w.begin, which == 0 ? w.exp_avg : w.exp_avg_sq);
      if (gr.windows.empty()) add(0, torch::empty({0}, gr.params.options()));
    }
  }
  return out;
}

std::vector<torch::Tensor> flat_adamw::flat_params() const {
  std::vector<torch::Tensor> out;
  for (const auto& g : groups_) out.push_back(g.params);
  return out;
}

std::vector<torch::Tensor> flat_adamw::flat_grads() {
  TORCH_CHECK(!fp32_grads_windowed(), "flat_grads: the gradients are sharded (train.zero = 2, or 1 in mixed precision)");
  gather_grads();  // every parameter's grad is a view of its group's buffer
  std::vector<torch::Tensor> out;
  for (const auto& g : groups_) out.push_back(g.grads);
  return out;
}

int64_t flat_adamw::total_elements() const {
  int64_t n = 0;
  for (const auto& g : groups_) n += g.params.numel();
  return n;
}

int64_t flat_adamw::state_bytes() const {
  int64_t n = 0;
  for (const auto& g : groups_)
    for (const auto& w : g.windows)
      if (!is_lazy(w.exp_avg)) n += 2 * w.exp_avg.numel() * w.exp_avg.element_size();
  return n;
}

int64_t flat_adamw::param_bytes() const {
  int64_t n = 0;
  for (const auto& g : groups_) {
    n += g.params.numel() * g.params.element_size();
    if (mixed_) n += g.compute.numel() * g.compute.element_size();
  }
  return n;
}

int64_t flat_adamw::grad_bytes() const {
  int64_t n = 0;
  for (const auto& g : groups_) {
    n += g.grads.numel() * g.grads.element_size();
    if (mixed_) n += g.compute_grads.numel() * g.compute_grads.element_size();
    if (fp32_grads_windowed())
      for (const auto& w : g.windows) n += w.grad.numel() * w.grad.element_size();
  }
  return n;
}

void flat_adamw::shard(const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  torch::NoGradGuard no_grad;
  const int64_t total = total_elements();
  (void)total;
  sharded_ = true;
  for (auto& g : groups_) {
    const int64_t n = g.params.numel();
    std::vector<window> next;
    for (const auto& [a, b] : ranges) {
      const int64_t lo = std::max<int64_t>(a - g.base, 0), hi = std::min<int64_t>(b - g.base, n);
      if (lo >= hi) continue;
      // The same range as an old window: its moments as they are (no copy,
      // no new pages). While the old window is retired both share them;
      // nothing writes them before drop_retired (a rank receives only what
      // it did not hold, and the update waits for the sends).
      const auto same = std::find_if(g.windows.begin(), g.windows.end(),
                                     [&](const window& old) { return old.begin == lo && old.exp_avg.numel() == hi - lo; });
      if (same != g.windows.end()) {
        window w{lo, same->exp_avg, same->exp_avg_sq, {}};
        // Its gradients' buffer too, pages already in: the next step zeroes
        // it before anything delivers (a fresh one faulted in 0.8 GB there
        // for a 202M model).
        if (fp32_grads_windowed())
          w.grad = same->grad.defined() && same->grad.numel() == hi - lo ? same->grad : untouched_zeros(hi - lo, g.params.options());
        next.push_back(std::move(w));
        continue;
      }
      // Lazy zeros again when all it keeps of the old windows are lazy zeros.
      bool lazy = true;
      for (const auto& old : g.windows) {
        const int64_t olo = std::max(lo, old.begin), ohi = std::min(hi, old.begin + old.exp_avg.numel());
        if (olo < ohi && !is_lazy(old.exp_avg)) lazy = false;
      }
      window w{lo, lazy ? lazy_zeros(hi - lo, g.params.options()) : torch::zeros({hi - lo}, g.params.options()),
               lazy ? lazy_zeros(hi - lo, g.params.options()) : torch::zeros({hi - lo}, g.params.options()), {}};
      // Untouched until a step delivers (or converts) into it: at a fresh
      // rank's first generation this window is the whole model for a moment.
      if (fp32_grads_windowed()) w.grad = untouched_zeros(hi - lo, g.params.options());
      // Keep what was held already.
      for (const auto& old : g.windows) {
        const int64_t olo = std::max(lo, old.begin), ohi = std::min(hi, old.begin + old.exp_avg.numel());
        if (olo >= ohi || lazy) continue;
        w.exp_avg.narrow(0, olo - lo, ohi - olo).copy_(old.exp_avg.narrow(0, olo - old.begin, ohi - olo));
        w.exp_avg_sq.narrow(0, olo - lo, ohi - olo).copy_(old.exp_avg_sq.narrow(0, olo - old.begin, ohi - olo));
      }
      next.push_back(std::move(w));
    }
    if (!sharded_ && next.empty())
      next.push_back(window{0, torch::zeros({0}, g.params.options()), torch::zeros({0}, g.params.options()),
                            fp32_grads_windowed() ? torch::zeros({0}, g.params.options()) : torch::Tensor()});
    g.retired = std::move(g.windows);
    g.windows = std::move(next);
    retired_pending_ = true;
    // Mixed precision: the float32 gradients are the windows' from now on
    // (the bf16 ones the module accumulates into stay whole).
    if (fp32_grads_windowed()) g.grads = torch::empty({0}, g.params.options());
  }
  if (mixed_ && !grads_sharded_) {
    for (auto& s : slots_) s.grad_view = torch::Tensor();
    grads_converted_ = false;  // the new windows hold nothing yet
  }
}

std::vector<std::pair<int64_t, int64_t>> flat_adamw::held_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& g : groups_)
    for (const auto& w : g.windows) {
      const int64_t a = g.base + w.begin, b = a + w.exp_avg.numel();
      if (a == b) continue;
      if (!out.empty() && out.back().second == a)
        out.back().second = b;
      else
        out.emplace_back(a, b);
    }
  return out;
}

std::vector<int64_t> flat_adamw::group_bases() const {
  std::vector<int64_t> out;
  for (const auto& g : groups_) out.push_back(g.base);
  return out;
}

std::pair<torch::Tensor, torch::Tensor> flat_adamw::moments(int64_t begin, int64_t end, bool retired) {
  for (auto& g : groups_) {
    if (begin < g.base || end > g.base + g.params.numel()) continue;
    for (auto& w : retired ? g.retired : g.windows) {
      const int64_t lo = begin - g.base - w.begin;
      if (lo < 0 || end - g.base > w.begin + w.exp_avg.numel()) continue;
      if (retired)  // read (sent on): lazy zeros as a dense copy of the range
        return {w.exp_avg.narrow(0, lo, end - begin).contiguous(), w.exp_avg_sq.narrow(0, lo, end - begin).contiguous()};
      // Written into (received): real zeros whose pages are the kernel's
      // until the moments arrive, so that they fault in as they land (on
      // the transfer's thread when healing), not all at once here.
      if (is_lazy(w.exp_avg)) w.exp_avg = untouched_zeros(w.exp_avg.numel(), w.exp_avg.options());
      if (is_lazy(w.exp_avg_sq)) w.exp_avg_sq = untouched_zeros(w.exp_avg_sq.numel(), w.exp_avg_sq.options());
      return {w.exp_avg.narrow(0, lo, end - begin), w.exp_avg_sq.narrow(0, lo, end - begin)};
    }
  }
  TORCH_CHECK(false, "optimizer state of elements [", begin, ", ", end, ") is not held here");
}

int64_t flat_adamw::resident_bytes() const {
  if (sharded_ || grads_sharded_) return 0;
  int64_t n = 0;
  for (const auto& g : groups_) {
    n += 3 * g.params.numel() * g.params.element_size();  // gradients and two moments
    if (mixed_) n += g.compute_grads.numel() * g.compute_grads.element_size();  // and the bf16 gradients
  }
  return n;
}

void flat_adamw::make_resident() {
  if (sharded_ || grads_sharded_) return;
  torch::NoGradGuard no_grad;
  materialize();
  for (auto& g : groups_) {
    g.grads.zero_();  // between steps they hold zeros: the same values, now in touched pages
    if (mixed_) g.compute_grads.zero_();
  }
}

void flat_adamw::drop_retired() {
  for (auto& g : groups_) g.retired.clear();
  retired_pending_ = false;
}

void flat_adamw::restore_retired() {
  if (!retired_pending_) return;
  for (auto& g : groups_) {
    g.windows = std::move(g.retired);
    g.retired.clear();
  }
  retired_pending_ = false;
}

std::vector<torch::Tensor> flat_adamw::param_views(int64_t begin, int64_t end) const {
  std::vector<torch::Tensor> out;
  for (const auto& g : groups_) {
    const int64_t lo = std::max<int64_t>(begin - g.base, 0), hi = std::min<int64_t>(end - g.base, g.params.numel());
    if (lo < hi) out.push_back(g.params.narrow(0, lo, hi - lo));
  }
  return out;
}

void flat_adamw::save(torch::serialize::OutputArchive& ar) const {
  TORCH_CHECK(!sharded_, "a sharded optimizer's state is saved through the state stream, not an archive");
  const_cast<flat_adamw*>(this)->materialize();
  ar.write("flat_adamw.version", torch::tensor(int64_t{1}));
  ar.write("flat_adamw.step", torch::tensor(step_));
  for (size_t g = 0; g < groups_.size(); ++g) {
    ar.write("flat_adamw.exp_avg." + std::to_string(g), groups_[g].windows[0].exp_avg);
    ar.write("flat_adamw.exp_avg_sq." + std::to_string(g), groups_[g].windows[0].exp_avg_sq);
  }
}

void flat_adamw::load(torch::serialize::InputArchive& ar) {
  TORCH_CHECK(!sharded_, "a sharded optimizer's state is loaded through the state stream, not an archive");
  materialize();
  torch::NoGradGuard no_grad;
  torch::Tensor version;
  if (ar.try_read("flat_adamw.version", version)) {
    TORCH_CHECK(version.item<int64_t>() == 1, "optimizer state version ", version.item<int64_t>(), " is newer than this dtactor");
    torch::Tensor st;
    ar.read("flat_adamw.step", st);
    std::vector<torch::Tensor> avg(groups_.size()), sq(groups_.size());
    for (size_t g = 0; g < groups_.size(); ++g) {
      ar.read("flat_adamw.exp_avg." + std::to_string(g), avg[g]);
      ar.read("flat_adamw.exp_avg_sq." + std::to_string(g), sq[g]);
      TORCH_CHECK(avg[g].sizes() == groups_[g].params.sizes() && sq[g].sizes() == groups_[g].params.sizes(), "optimizer state of parameter group ", g,
                  " has ", avg[g].numel(), " values, the model ", groups_[g].params.numel());
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      groups_[g].windows[0].exp_avg.copy_(avg[g]);
      groups_[g].windows[0].exp_avg_sq.copy_(sq[g]);
    }
    step_ = st.item<int64_t>();
    return;
  }
  // torch::optim::AdamW's format (checkpoints written before the flat
  // optimizer): load it into an AdamW over stand-ins of the same shapes, in
  // the same groups, and copy its per-parameter state into the buffers.
  std::vector<torch::Tensor> decay, no_decay;
  for (auto& p : decay_order_) decay.push_back(torch::zeros_like(p).requires_grad_(true));
  for (auto& p : no_decay_order_) no_decay.push_back(torch::zeros_like(p).requires_grad_(true));
  std::vector<torch::optim::OptimizerParamGroup> pg;
  pg.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>());
  pg.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>());
  torch::optim::AdamW old(std::move(pg), torch::optim::AdamWOptions());
  old.load(ar);
  auto find = [&](const torch::Tensor& stand_in) -> torch::optim::AdamWParamState* {
    auto it = old.state().find(c10::guts::to_string(stand_in.unsafeGetTensorImpl()));
    return it == old.state().end() ? nullptr : static_cast<torch::optim::AdamWParamState*>(it->second.get());
  };
  int64_t step = 0;
  auto copy_state = [&](const std::vector<torch::Tensor>& originals, const std::vector<torch::Tensor>& stand_ins) {
    for (size_t i = 0; i < originals.size(); ++i) {
      const slot* s = nullptr;
      for (const auto& x : slots_)
        if (x.param.unsafeGetTensorImpl() == originals[i].unsafeGetTensorImpl()) s = &x;
      auto* st = find(stand_ins[i]);
      if (!s) continue;
      if (!st) {
        view(groups_[s->group].windows[0].exp_avg, *s).zero_();
        view(groups_[s->group].windows[0].exp_avg_sq, *s).zero_();
        continue;
      }
      TORCH_CHECK(st->exp_avg().sizes() == s->param.sizes(), "optimizer state does not fit parameter ", i);
      view(groups_[s->group].windows[0].exp_avg, *s).copy_(st->exp_avg());
      view(groups_[s->group].windows[0].exp_avg_sq, *s).copy_(st->exp_avg_sq());
      step = std::max(step, st->step());
    }
  };
  copy_state(decay_order_, decay);
  copy_state(no_decay_order_, no_decay);
  step_ = step;
}

}  // namespace dtactor
