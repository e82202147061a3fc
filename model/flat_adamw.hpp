#pragma once
// AdamW over flat buffers: every parameter and every gradient is a view into
// one contiguous tensor per parameter group (weight decay or not, one dtype),
// so clipping, the optimizer step and zeroing are a handful of tensor ops per
// step instead of a handful per parameter, and the step itself is one fused
// loop over float32 CPU buffers (model/adamw_kernel). The arithmetic is
// torch::optim::AdamW's (1.13), element by element, so results match it to
// rounding; the gradient norm is summed in another order (model/grad_norm:
// the same at every ZeRO level and world size).
//
// Gradients stay views of the flat buffer as long as nobody replaces
// param.grad(): autograd accumulates into a defined gradient in place. If a
// gradient was replaced or reset (e.g. Module::zero_grad(true)), the next
// clip/step copies it back into the buffer first.
//
// Checkpoints: save() writes the flat state; load() also reads the optimizer
// section of older checkpoints, written by torch::optim::AdamW.
//
// Sharded (ZeRO-1, model/shard_plan): the moments are kept only for the
// elements of the ranges given to shard(), in the index space of all groups
// back to back; step() updates only those parameters (the caller all-gathers
// the rest). The update is element-wise, so a shard's parameters come out
// bit for bit as the unsharded optimizer's.
// In mixed precision the float32 gradients the step reads are then kept
// only for the held windows too: the module's bf16 gradients stay whole
// (the reducer allreduces them), and each step converts only the windows'
// part; the norm reads the bf16 ones, which hold the same values.
//
// Sharded gradients (ZeRO-2, shard_grads()): the gradients are kept only for
// the held windows too. Parameters' grads are then no views: autograd
// allocates them during backward, the data-parallel reducer (grad_sync's
// zero2 mode) moves them into its buckets and resets them, and delivers the
// world's sum of the held ranges into grad_window(); without a reducer (a
// world of one) clip/step move any defined grad into the windows first.
#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "model/grad_norm.hpp"
#include "model/state_tensor.hpp"

namespace dtactor {

struct flat_adamw_options {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  // What the module's parameters compute in. kBFloat16 (train.precision =
  // bf16): the flat float32 buffers are the master weights, and every
  // parameter becomes a bf16 view of a flat copy of them (refresh_compute
  // rounds the masters into it), its gradient a bf16 view of a flat bf16
  // buffer that clipping and the step read as float32.
  c10::ScalarType compute = torch::kFloat;
  // Mixed precision at train.zero = 3: between steps a rank keeps only its
  // shards' masters (and the units' gatherer those of no unit), so
  // refresh_compute() rounds the held windows only; the gatherer rounds
  // what it gathers (round_into_compute).
  bool held_masters_only = false;
};

class flat_adamw {
 public:
  // params: the module's parameters in module order; those with dim >= 2 get
  // weight decay, the others (biases, norms, embeddings of dim 1) do not.
  // Re-points every parameter's data into the flat buffers.
  flat_adamw(std::vector<torch::Tensor> params, const flat_adamw_options& o);

  void set_lr(double lr) { opts_.lr = lr; }
  // Global 2-norm of the gradients (the canonical one of model/grad_norm,
  // over every range: all of them must be held); scales them to max_norm
  // when above it (as torch::nn::utils::clip_grad_norm_). Returns the norm
  // before clipping.
  double clip_grad_norm(double max_norm);
  void step();
  void zero_grad();

  // After anything replaced the parameters' storage (Module::load uses set_):
  // copies their values back into the flat buffers and re-points them.
  void rebind();

  // Mixed precision (options' compute not float32): whether it is on; the
  // masters rounded into the parameters the module computes with (all of
  // them: call before a forward, after anything wrote the masters: a step,
  // a gather, a load); the master of parameter `p` (a float32 view; for
  // checkpoints and digests), undefined for one it does not step.
  bool mixed() const { return mixed_; }
  void refresh_compute();
  // train.zero = 3's units' gatherer (rank/zero3), while one lives: it
  // rounds the held windows' copies itself, a unit at a time right before
  // it gathers the unit, and gives them back with the unit, so that no
  // copy of a shard stays resident between uses; refresh_compute then
  // rounds nothing (the copies of parameters of no unit are the
  // gatherer's too). Counted: a gatherer on, one off.
  void copies_by_gatherer(bool on) { gatherers_rounding_ += on ? 1 : -1; }
  // The compute copies are already the masters' rounding, while the masters
  // of some held windows are still on their way (a reshard whose moves run
  // during the next step, rank/healing): the next refresh_compute rounds
  // nothing (it still marks the float32 gradients unconverted). false:
  // that no longer holds (the reshard's generation ended).
  void keep_compute_once(bool on = true) { keep_compute_once_ = on; }
  torch::Tensor master_of(const torch::Tensor& p) const;
  // Mixed precision: index-space [begin, end) of the masters rounded into
  // the compute copy (a gathered unit); the compute copy's views of it (one
  // per group it crosses; none when not mixed).
  void round_into_compute(int64_t begin, int64_t end);
  std::vector<torch::Tensor> compute_views(int64_t begin, int64_t end) const;

  void save(torch::serialize::OutputArchive& ar) const;
  // Reads what save() wrote, or torch::optim::AdamW's own format. Throws
  // c10::Error when the state does not fit these parameters.
  void load(torch::serialize::InputArchive& ar);

  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t n) { step_ = n; }

  // The optimizer's state as live flat tensors, for checkpoints and state
  // transfer (written into in place when loading): "optim/exp_avg.<g>",
  // "optim/exp_avg_sq.<g>" per parameter group, in group order; sharded, the
  // windows held (one empty window for a group with none).
  std::vector<state_tensor> state_tensors() const;

  // Elements of all groups back to back (the shard plan's index space).
  int64_t total_elements() const;
  // Keeps the moments only for `ranges` (ascending, disjoint, in the index
  // space); moments held before and still held are kept, newly held ones
  // start at zero. From then on the moments are windows (state_tensors),
  // even when one holds all of [0, total).
  void shard(const std::vector<std::pair<int64_t, int64_t>>& ranges);
  bool sharded() const { return sharded_; }
  // The parameters of index-space range [begin, end) as views, in order (one
  // per group the range crosses).
  std::vector<torch::Tensor> param_views(int64_t begin, int64_t end) const;
  // ZeRO-2: keep gradients only for the held windows (before or after
  // shard(); stays on). Frees the full gradient buffers.
  void shard_grads();
  bool grads_sharded() const { return grads_sharded_; }
  // The owner's word that nothing has written the full gradient buffers
  // since construction (a training state whose first backward has not
  // run): shard_grads then reads none of them, which would make pages of
  // fresh, untouched buffers resident on a kernel without a shared zero
  // page. grads_written() (before a backward) ends it.
  void grads_unwritten() { grads_unwritten_ = true; }
  void grads_written() { grads_unwritten_ = false; }
  // The gradients of [begin, end) (one group, one held window) as a view:
  // where the reducer delivers the summed gradients.
  torch::Tensor grad_window(int64_t begin, int64_t end) const;
  // The gradient norm's ranges over this optimizer's index space
  // (model/grad_norm: chunks cut at group boundaries).
  index_ranges norm_ranges() const;
  // Sum of squares of the held gradients of each of ranges[first, last)
  // (ranges of norm_ranges(), each held here), in double: the same bits
  // whoever holds the range.
  std::vector<double> grad_range_squares(const index_ranges& ranges, size_t first, size_t last);
  // Clipping with a norm worked out elsewhere (the global norm of sharded
  // gradients): scales the held gradients as clip_grad_norm would.
  void clip_to(double norm, double max_norm);
  // Each parameter's first element in the index space, in the constructor's
  // order (those that require grad).
  std::vector<int64_t> param_index() const;
  // Where parameter `p` (the same tensor, not a copy) lies in the index
  // space: [first, first + numel); nullopt for one it does not step.
  std::optional<std::pair<int64_t, int64_t>> range_of(const torch::Tensor& p) const;
  // The index of the parameter element at `data` (nullopt: not in the flat
  // parameters).
  std::optional<int64_t> index_at(const void* data) const;
  // Bytes of optimizer state held; of parameters and of gradient buffers.
  int64_t state_bytes() const;
  int64_t param_bytes() const;
  int64_t grad_bytes() const;
  // Index-space ranges whose moments are held, ascending, adjacent merged.
  std::vector<std::pair<int64_t, int64_t>> held_ranges() const;
  // Each group's first element in the index space, in group order.
  std::vector<int64_t> group_bases() const;
  // Views of the moments (exp_avg, exp_avg_sq) of [begin, end), which must
  // lie in one group and one held window; `retired`: in the windows shard()
  // last replaced (kept until drop_retired(), for sending them on).
  // Moments not written yet take no memory until first written (a step, a
  // load, a receive): a fresh optimizer sharded before its first step never
  // allocates what it gives away.
  std::pair<torch::Tensor, torch::Tensor> moments(int64_t begin, int64_t end, bool retired = false);
  void drop_retired();
  // The windows shard() last replaced become the held ones again (the new
  // ones dropped): a reshard called off before the moves into the new
  // windows all landed, and before any update. Nothing after drop_retired().
  void restore_retired();
  // Unsharded: the gradient buffers and the moments made resident now (their
  // pages touched; lazy moments become real zeros), so that the first step,
  // or a state received from a peer, does not fault them in on the critical
  // path. Bytes it may touch first: resident_bytes(). Nothing when sharded.
  void make_resident();
  int64_t resident_bytes() const;

  // Each group's flat parameters and flat gradients (not sharded: ZeRO-2's
  // gradients are windows), live: DiLoCo's outer step works on them.
  std::vector<torch::Tensor> flat_params() const;
  std::vector<torch::Tensor> flat_grads();

 private:
  struct slot {
    torch::Tensor param;
    size_t group = 0;
    int64_t offset = 0, numel = 0;
    torch::Tensor param_view, grad_view;  // this parameter's place in its group's buffers
    torch::Tensor compute_view, compute_grad_view;  // mixed(): its place in the compute copies
  };
  // Moments of elements [begin, begin + exp_avg.numel()) of a group.
  struct window {
    int64_t begin = 0;
    torch::Tensor exp_avg, exp_avg_sq;
    torch::Tensor grad;  // fp32_grads_windowed(): the float32 gradients of the window
  };
  struct group {
    bool decay = false;
    int64_t base = 0;             // its first element in the index space
    torch::Tensor params, grads;  // flat
    torch::Tensor compute, compute_grads;  // mixed(): the flat copies the module computes with
    std::vector<window> windows;  // ascending; one covering the group when unsharded
    std::vector<window> retired;  // what shard() replaced, until drop_retired()
  };
  torch::Tensor view(const torch::Tensor& flat, const slot& s) const { return flat.narrow(0, s.offset, s.numel).view(s.param.sizes()); }
  void materialize();   // lazy zero moments become real tensors
  void attach_compute_copies(bool deferred);  // mixed precision: parameters and grads re-pointed into the compute copies
  // Where the held gradients of [begin, end) start: within one group's
  // buffer (sharded: one held window's), which is 1-D.
  struct held_span {
    const torch::Tensor* buffer;
    int64_t offset;
  };
  held_span held_grads(int64_t begin, int64_t end) const;
  void gather_grads();  // grads that are not views of the buffer are copied into it (sharded: into the windows, then reset)
  void adopt_param_grads();  // unsharded: each parameter's grad into its view of the full buffer (bf16's when mixed)
  // The float32 gradients are kept per held window (w.grad): sharded
  // gradients (ZeRO-2), or mixed precision sharded (ZeRO-1: the module's
  // bf16 gradients are whole, the step reads only its windows' as float32).
  bool fp32_grads_windowed() const { return grads_sharded_ || (mixed_ && sharded_); }
  torch::Tensor grads_of(const group& g, const window& w) const {
    return fp32_grads_windowed() ? w.grad : g.grads.narrow(0, w.begin, w.exp_avg.numel());
  }

  std::vector<slot> slots_;
  std::vector<group> groups_;
  std::vector<torch::Tensor> decay_order_, no_decay_order_;  // torch::optim::AdamW's param group order (older checkpoints)
  flat_adamw_options opts_;
  int64_t step_ = 0;
  bool sharded_ = false;
  bool retired_pending_ = false;  // shard() replaced windows that neither drop_retired() nor restore_retired() has ended
  bool grads_sharded_ = false;
  bool mixed_ = false;
  int gatherers_rounding_ = 0;  // copies_by_gatherer
  bool grads_unwritten_ = false;  // grads_unwritten
  bool keep_compute_once_ = false;  // keep_compute_once
  bool grads_converted_ = false;  // mixed(): the compute grads copied into the float32 ones since the last refresh_compute
};

}  // namespace dtactor
