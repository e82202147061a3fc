#include "model/diloco.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "comm/grad_sync.hpp"

namespace dtactor {

int64_t resolved_overlap(int64_t configured, int fragments) {
  if (configured >= 0) return configured;
  return fragments > 1 ? 1 : 0;
}

std::vector<std::pair<size_t, size_t>> cut_fragments(const std::vector<int64_t>& numels, int fragments) {
  std::vector<std::pair<size_t, size_t>> out;
  const size_t n = numels.size();
  if (fragments < 1 || n < static_cast<size_t>(fragments)) return out;
  int64_t total = 0;
  for (auto x : numels) total += x;
  size_t first = 0;
  int64_t cum = 0;
  for (int k = 0; k < fragments; ++k) {
    const size_t left_after = static_cast<size_t>(fragments - k - 1);  // fragments still to fill after this one
    // The share this fragment closes at (the last takes the rest).
    const long double target = static_cast<long double>(total) * (k + 1) / fragments;
    size_t end = first + 1;
    cum += numels[first];
    while (end < n - left_after && static_cast<long double>(cum) < target) cum += numels[end++];
    if (k == fragments - 1) {
      while (end < n) cum += numels[end++];
    }
    out.emplace_back(first, end - first);
    first = end;
  }
  return out;
}

outer_optimizer::outer_optimizer(flat_adamw& inner, const std::vector<int64_t>& param_numels, outer_options o) : inner_(inner), o_(o) {
  torch::NoGradGuard no_grad;
  for (const auto& p : inner_.flat_params()) {
    global_.push_back(p.detach().clone());
    momentum_.push_back(torch::zeros_like(p));
  }
  anchor_ = torch::zeros({1}, torch::kInt64);
  const int f_count = std::max(1, o_.fragments);
  const auto cuts = cut_fragments(param_numels, f_count);
  if (cuts.empty())
    throw std::invalid_argument("train.sync_fragments = " + std::to_string(f_count) + " but the model has only " + std::to_string(param_numels.size()) +
                                " parameter tensors to share among them");
  const auto index = inner_.param_index();
  auto bases = inner_.group_bases();
  if (index.size() != param_numels.size()) throw std::invalid_argument("outer_optimizer: parameter sizes do not match the inner optimizer's");
  for (size_t k = 0; k < cuts.size(); ++k) {
    outer_fragment fr;
    fr.first_param = cuts[k].first;
    fr.params = cuts[k].second;
    fr.offset = k + 1 == cuts.size() ? o_.every : o_.every * static_cast<int64_t>(k + 1) / static_cast<int64_t>(cuts.size());
    for (size_t i = fr.first_param; i < fr.first_param + fr.params; ++i) {
      const int64_t at = index[i];
      size_t g = 0;
      while (g + 1 < bases.size() && bases[g + 1] <= at) ++g;
      const int64_t off = at - bases[g], len = param_numels[i];
      fr.elements += len;
      if (len == 0) continue;
      // Adjacent in the same group: one range.
      bool merged = false;
      for (auto& [rg, ro, rl] : fr.ranges)
        if (rg == g && ro + rl == off) {
          rl += len;
          merged = true;
          break;
        }
      if (!merged) fr.ranges.emplace_back(g, off, len);
    }
    fragments_.push_back(std::move(fr));
  }
  fragment_anchors_ = torch::zeros({static_cast<int64_t>(fragments_.size())}, torch::kInt64);
}

int64_t outer_optimizer::fragment_anchor(size_t f) const {
  // Not streaming, the one fragment's anchor is the anchor (both move at
  // once, and only the anchor is in the state).
  if (!streaming()) return anchor();
  return fragment_anchors_.data_ptr<int64_t>()[f];
}

std::vector<size_t> outer_optimizer::due_fragments(int64_t step) const {
  std::vector<size_t> out;
  for (size_t f = 0; f < fragments_.size(); ++f) {
    if (flying_ && *flying_ == f) continue;
    int64_t last = 0;  // the last scheduled synchronisation at or before `step`
    if (step >= o_.max_steps) {
      last = step;
    } else if (o_.every > 0 && step >= fragments_[f].offset) {
      last = fragments_[f].offset + (step - fragments_[f].offset) / o_.every * o_.every;
    }
    if (last > 0 && last > fragment_anchor(f)) out.push_back(f);
  }
  return out;
}

int64_t outer_optimizer::boundary_after(int64_t step) const {
  int64_t best = o_.max_steps;
  for (const auto& fr : fragments_) {
    if (o_.every <= 0) break;
    int64_t next = step < fr.offset ? fr.offset : fr.offset + ((step - fr.offset) / o_.every + 1) * o_.every;
    best = std::min(best, next);
  }
  return best;
}

bool outer_optimizer::lands(int64_t step) const {
  if (!flying_) return false;
  if (step >= launched_at_ + o_.overlap || step >= o_.max_steps) return true;
  return !due_fragments(step).empty();
}

template <class F>
void outer_optimizer::each_range(size_t f, F&& fn) const {
  for (const auto& [g, off, len] : fragments_[f].ranges) fn(g, off, len);
}

double outer_optimizer::launch(size_t f, int64_t step, bool keep) {
  torch::NoGradGuard no_grad;
  const auto params = inner_.flat_params();
  auto grads = inner_.flat_grads();
  double sq = 0;
  kept_.clear();
  each_range(f, [&](size_t g, int64_t off, int64_t len) {
    auto d = grads[g].narrow(0, off, len);
    torch::sub_out(d, global_[g].narrow(0, off, len), params[g].narrow(0, off, len));
    const double n = d.norm().item<double>();
    sq += n * n;
    if (keep) kept_.push_back(d.clone());
  });
  flying_ = f;
  launched_at_ = step;
  return std::sqrt(sq);
}

double outer_optimizer::land(int workers, int64_t step) {
  if (!flying_) return 0;
  torch::NoGradGuard no_grad;
  const size_t f = *flying_;
  const auto params = inner_.flat_params();
  auto grads = inner_.flat_grads();
  const bool merge = step > launched_at_;
  double sq = 0;
  size_t k = 0;
  each_range(f, [&](size_t g, int64_t off, int64_t len) {
    auto d = grads[g].narrow(0, off, len);
    if (!kept_.empty()) d.copy_(kept_[k++]);
    d.div_(static_cast<double>(std::max(1, workers)));
    const double n = d.norm().item<double>();
    sq += n * n;
    // torch.optim.SGD(momentum=mu, nesterov=True) without dampening: the
    // first step's buffer is the gradient itself, as mu * 0 + d.
    auto m = momentum_[g].narrow(0, off, len);
    auto gl = global_[g].narrow(0, off, len);
    auto p = params[g].narrow(0, off, len);
    m.mul_(o_.momentum).add_(d);
    d.add_(m, o_.momentum);
    gl.sub_(d, o_.lr);
    if (merge) {
      p.mul_(o_.mix).add_(gl, 1.0 - o_.mix);
    } else {
      p.copy_(gl);
    }
    d.zero_();
  });
  fragment_anchors_.data_ptr<int64_t>()[f] = launched_at_;
  anchor_.fill_(step);
  flying_.reset();
  kept_.clear();
  return std::sqrt(sq);
}

void outer_optimizer::drop_flight() {
  flying_.reset();
  kept_.clear();
}

status outer_optimizer::after_inner_step(int64_t at, int64_t max_steps, const fragment_sync& sync_of, const std::optional<step_control>& control,
                                         const std::function<void(const outer_step_result&)>& each) {
  bool landed = false;
  if (lands(at)) {
    auto o = land_exchange(at, sync_of(*flying_));
    if (!o) return o.err();
    each(*o);
    landed = true;
  }
  const auto due = due_fragments(at);
  for (size_t f : due) {
    grad_sync& sync = sync_of(f);
    if (control) sync.set_control(*control);
    const bool overlap = o_.overlap > 0 && at < max_steps && due.size() == 1 && !landed;
    auto o = launch_exchange(f, at, sync, overlap);
    if (!o) return o.err();
    each(*o);
  }
  return {};
}

result<outer_step_result> outer_optimizer::step(int64_t at, grad_sync& sync) {
  const auto due = due_fragments(at);
  return launch_exchange(due.empty() ? 0 : due.front(), at, sync, false);
}

result<outer_step_result> outer_optimizer::launch_exchange(size_t f, int64_t at, grad_sync& sync, bool overlap) {
  if (before_update_) before_update_();
  outer_step_result r;
  r.fragment = f;
  r.payload_bytes = payload_bytes(f);
  flight_window_ = at - fragment_anchor(f);
  r.inner_steps = flight_window_;
  inner_.zero_grad();
  launch(f, at, overlap && sync.world() <= 1);
  if (overlap) {
    // Packed and on its way: the gradient buffers are the inner steps' again.
    sync.launch_all();
    inner_.zero_grad();
    return r;
  }
  return land_exchange(at, sync);
}

result<outer_step_result> outer_optimizer::land_exchange(int64_t at, grad_sync& sync) {
  if (before_update_) before_update_();
  outer_step_result r;
  if (!flying_) return make_error("no DiLoCo exchange in flight");
  r.fragment = *flying_;
  r.payload_bytes = payload_bytes(r.fragment);
  r.inner_steps = flight_window_;
  // The inner step before this one zeroed the gradient buffers; the reducer
  // writes the fragment's sums there.
  auto synced = sync.finish();
  if (!synced) {
    drop_flight();
    inner_.zero_grad();
    return synced.err();
  }
  r.exchange_s = synced->allreduce_s;
  r.exposed_s = synced->exposed_s;
  const auto t0 = std::chrono::steady_clock::now();
  r.pseudo_grad_norm = land(sync.world(), at);
  r.update_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.landed = true;
  return r;
}

void outer_optimizer::reset_to_global() {
  torch::NoGradGuard no_grad;
  const auto params = inner_.flat_params();
  for (size_t g = 0; g < params.size(); ++g) params[g].copy_(global_[g]);
}

void outer_optimizer::swap_global() {
  torch::NoGradGuard no_grad;
  const auto params = inner_.flat_params();
  for (size_t g = 0; g < params.size(); ++g) {
    auto tmp = params[g].clone();
    params[g].copy_(global_[g]);
    global_[g].copy_(tmp);
  }
}

int64_t outer_optimizer::payload_bytes() const {
  int64_t n = 0;
  for (const auto& t : global_) n += t.numel() * t.element_size();
  return n;
}

std::vector<state_tensor> outer_optimizer::state_tensors() const {
  std::vector<state_tensor> out;
  for (size_t g = 0; g < global_.size(); ++g) out.push_back(state_tensor::whole("outer/global." + std::to_string(g), global_[g]));
  for (size_t g = 0; g < momentum_.size(); ++g) out.push_back(state_tensor::whole("outer/momentum." + std::to_string(g), momentum_[g]));
  out.push_back(state_tensor::whole("outer/anchor", anchor_));
  if (streaming()) out.push_back(state_tensor::whole("outer/fragment_anchors", fragment_anchors_));
  return out;
}

}  // namespace dtactor
