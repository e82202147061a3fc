// The shared-memory transports of gradient buckets: the whole world on one
// host, and the hierarchical exchange (shared memory within a host, one
// leader per host on the wire). See exchange.hpp for the contract.
#include "comm/exchange.hpp"

#include <functional>
#include <optional>

namespace dtactor {

namespace {

// A bucket list laid out in a shm_group's ring: at a step's first use every
// bucket gets its region (the ring's next ones, in bucket order, alike on
// every rank). Backward packs a bucket straight into its region when the
// region is free already (every rank consumed what was there: always when
// the ring holds two steps); otherwise into the bucket's flat tensor, and
// start() copies it once the region is free, consuming what this rank can
// meanwhile (a ring smaller than a step). Consumption is in bucket order.
class shm_slots {
 public:
  shm_slots(std::vector<exchange_bucket>& buckets, std::shared_ptr<shm_group> shm) : buckets_(buckets), shm_(std::move(shm)) {}
  shm_group& group() const { return *shm_; }

  // Reserves the step's regions (once a step).
  status begin_step() {
    if (!regions_.empty()) return {};
    for (auto& b : buckets_) {
      auto g = shm_->reserve(b.numel);
      if (!g) return g.err();
      regions_.push_back(g.value());
    }
    direct_.assign(buckets_.size(), -1);
    next_consume_ = 0;
    return {};
  }
  // Bucket `b`'s region in rank r's slot of this step.
  torch::Tensor region(size_t b, int r) const {
    return torch::from_blob(shm_->at(r, regions_[b]), {buckets_[b].numel}, torch::kFloat);
  }
  torch::Tensor mine(size_t b) const { return region(b, shm_->rank()); }
  // Where backward packs bucket b: its region when free now, else its flat
  // tensor (decided at the first call of the step, kept until start).
  torch::Tensor staging(size_t b) {
    if (!begin_step()) return buckets_[b].flat;  // start() reports it
    if (direct_[b] < 0) direct_[b] = shm_->is_free(regions_[b]) ? 1 : 0;
    return direct_[b] ? mine(b) : buckets_[b].flat;
  }
  // Bucket b is packed: into its region if it is not there yet (waiting
  // for it to be free, consuming meanwhile with `consume_one`), published.
  status publish(size_t b, exchange_clock::time_point deadline, const exchange_waits& w, const std::function<status()>& consume_one) {
    if (auto st = begin_step(); !st) return st;
    if (direct_[b] < 0) direct_[b] = shm_->is_free(regions_[b]) ? 1 : 0;
    if (!direct_[b]) {
      if (auto st = shm_->wait_free(regions_[b], deadline, w.abandon, w.spin, buckets_[b].label, consume_one); !st) return st;
      torch::NoGradGuard no_grad;
      mine(b).copy_(buckets_[b].flat);
    }
    shm_->publish(regions_[b]);
    return {};
  }
  // The bucket after b would not be free to pack: the ring is tight, so
  // this rank consumes what it can now rather than at the step's end.
  bool tight_after(size_t b) const { return b + 1 < regions_.size() && !shm_->is_free(regions_[b + 1]); }
  uint64_t count(size_t b) const { return regions_[b].count; }
  size_t next_consume() const { return next_consume_; }
  void consumed(size_t b) {
    shm_->consume(regions_[b].count);
    next_consume_ = b + 1;
  }
  // The world's regions of bucket b summed into its flat tensor, in the same
  // order on every rank: bit-identical sums everywhere.
  // train.zero = 2 (kept_by): only the pieces this rank keeps and the
  // control words, each in the same order as the whole bucket's sum; with
  // `whole` (a host's leader, whose sum crosses hosts for every rank of the
  // world), the whole bucket all the same.
  void sum_into(size_t bi, bool whole = false) {
    const auto& b = buckets_[bi];
    auto sum_of = [&](int64_t off, int64_t len) {
      std::vector<torch::Tensor> srcs;
      for (int r = 0; r < shm_->world(); ++r) srcs.push_back(region(bi, r).narrow(0, off, len));
      sum_slots(b.flat.narrow(0, off, len), srcs, scratch_);
    };
    if (b.kept_by.empty() || whole) {
      sum_of(0, b.numel);
    } else {
      for (const auto& [off, len] : b.kept_by[static_cast<size_t>(shm_->rank())]) sum_of(off, len);
      if (b.control_words() > 0) sum_of(b.grads, b.control_words());
    }
    b.mark_done();
  }
  void end_step() { regions_.clear(); }

 private:
  std::vector<exchange_bucket>& buckets_;
  std::shared_ptr<shm_group> shm_;
  std::vector<shm_group::region> regions_;  // this step's, by bucket (empty between steps)
  std::vector<int8_t> direct_;              // packed straight into the region (1), into flat (0), not yet decided (-1)
  size_t next_consume_ = 0;                 // buckets below it this rank has read
  std::vector<torch::Tensor> scratch_;      // sum_slots' temporaries
};

// Every rank on one host: each bucket is published into this rank's slot as
// soon as backward filled it; wait() sums the ranks' slots.
class shm_exchange final : public bucket_exchange {
 public:
  shm_exchange(std::vector<exchange_bucket>& buckets, std::shared_ptr<shm_group> shm, const exchange_waits& w)
      : bucket_exchange(buckets), slots_(buckets, std::move(shm)), waits_(w) {}
  torch::Tensor staging(size_t b) override { return slots_.staging(b); }
  status start(size_t b) override {
    buckets_[b].mark_launched();
    const auto deadline = exchange_clock::now() + waits_.timeout;
    if (auto st = slots_.publish(b, deadline, waits_, [this, b] { return consume_ready(b); }); !st) return st;
    if (slots_.tight_after(b)) return consume_ready(b + 1);
    return {};
  }
  status wait(size_t b, exchange_clock::time_point deadline) override {
    if (b < slots_.next_consume()) return {};  // summed while the ring was tight
    if (auto st = slots_.group().wait_all(slots_.count(b), deadline, waits_.abandon, waits_.spin, buckets_[b].label); !st) return st;
    slots_.sum_into(b);
    slots_.consumed(b);
    return {};
  }
  void end_step() override { slots_.end_step(); }
  const char* label_stem() const override { return ": shared-memory reduction of gradient bucket "; }
  bool uses_shm() const override { return true; }
  bool waits_early() const override { return true; }

 private:
  // Sums, without waiting, the buckets below `limit` every rank published.
  status consume_ready(size_t limit) {
    while (slots_.next_consume() < limit && slots_.group().all_published(slots_.count(slots_.next_consume()))) {
      const size_t b = slots_.next_consume();
      slots_.sum_into(b);
      slots_.consumed(b);
    }
    return {};
  }

  shm_slots slots_;
  exchange_waits waits_;
};

// Several hosts with several ranks on some: the ranks of a host publish
// their buckets into shared memory as backward fills them; the leader
// (rank 0 of the host's group, or the host's only rank) sums them
// (sum_slots' order), sends the host's sum across hosts with its wire
// transport, and writes the result back into its slot for the host's other
// ranks. Only one copy of the gradients per host crosses the network.
class hierarchical_exchange final : public bucket_exchange {
 public:
  hierarchical_exchange(std::vector<exchange_bucket>& buckets, std::shared_ptr<shm_group> shm, std::unique_ptr<bucket_exchange> across,
                        const exchange_waits& w)
      : bucket_exchange(buckets), across_(std::move(across)), waits_(w) {
    if (shm && shm->world() > 1) slots_.emplace(buckets, std::move(shm));
  }
  torch::Tensor staging(size_t b) override { return slots_ ? slots_->staging(b) : buckets_[b].flat; }
  status start(size_t b) override {
    buckets_[b].mark_launched();
    ++started_;
    // The host's leader sums it. The ring holds a whole step here
    // (make_exchange), so a region waits only for the step before.
    if (slots_)
      if (auto st = slots_->publish(b, exchange_clock::now() + waits_.timeout, waits_, {}); !st) return st;
    return across_ ? advance(false, {}) : status{};
  }
  status flush(exchange_clock::time_point deadline) override {
    if (!across_) return {};
    if (auto st = advance(true, deadline); !st) return st;
    return across_->flush(deadline);
  }
  status wait(size_t b, exchange_clock::time_point deadline) override {
    auto& bk = buckets_[b];
    if (across_) {
      if (auto st = across_->wait(b, deadline); !st) return st;
      if (slots_) {
        // The host's ranks read the result from this rank's region (nobody
        // else reads it in this mode).
        torch::NoGradGuard no_grad;
        slots_->mine(b).copy_(bk.flat);
        slots_->group().publish_result(slots_->count(b));
      }
      return {};
    }
    if (auto st = slots_->group().wait_result(slots_->count(b), deadline, waits_.abandon, waits_.spin, bk.label); !st) return st;
    torch::NoGradGuard no_grad;
    bk.flat.copy_(slots_->region(b, 0));
    bk.mark_done();
    slots_->consumed(b);
    return {};
  }
  void end_step() override {
    started_ = sent_ = 0;
    if (slots_) slots_->end_step();
    if (across_) across_->end_step();
  }
  // The host's other ranks wait for results that will not come.
  void abort() override {
    if (across_ && slots_) slots_->group().fail();
  }
  const char* label_stem() const override {
    return across_ ? ": exchange across hosts of gradient bucket " : ": result from this host's leader of gradient bucket ";
  }
  bool uses_shm() const override { return slots_.has_value(); }
  bool hierarchical() const override { return true; }
  bool host_leader() const override { return static_cast<bool>(across_); }

 private:
  // On the leader: sums the host's regions of the buckets the host has
  // published and sends them across hosts, in bucket order; with `block`,
  // waits for the host's ranks (flush), else only takes what is there.
  // The leader has read a bucket once it summed it; its region then holds
  // the result, which the others read before it is written again.
  status advance(bool block, exchange_clock::time_point deadline) {
    while (sent_ < started_) {
      auto& bk = buckets_[sent_];
      if (slots_) {
        const uint64_t want = slots_->count(sent_);
        if (!block && !slots_->group().all_published(want)) return {};
        if (block)
          if (auto st = slots_->group().wait_all(want, deadline, waits_.abandon, waits_.spin, bk.label); !st) return st;
        slots_->sum_into(sent_, true);
        slots_->consumed(sent_);
      }
      if (auto st = across_->start(sent_++); !st) return st;
    }
    return {};
  }

  std::optional<shm_slots> slots_;           // this host's segment, when the host has several ranks
  std::unique_ptr<bucket_exchange> across_;  // the leader's wire transport over the group of leaders
  exchange_waits waits_;
  size_t started_ = 0;  // buckets started in this step
  size_t sent_ = 0;     // ... of which the leader sent across hosts
};

}  // namespace

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

result<std::unique_ptr<bucket_exchange>> host_exchange(std::vector<exchange_bucket>& buckets, std::shared_ptr<shm_group> shm,
                                                       const exchange_waits& w) {
  if (!shm) return make_error("a host's reducer needs the host's shared-memory segment");
  int64_t largest = 0;
  for (auto& b : buckets) {
    if (b.flat.scalar_type() != torch::kFloat) return make_error("a host's reducer carries float32 gradients only");
    largest = std::max(largest, b.numel);
  }
  if (largest > shm->capacity())
    return make_error("a host's reducer needs " + std::to_string(largest) + " floats for its largest bucket, the segment's slot has " +
                      std::to_string(shm->capacity()));
  return std::unique_ptr<bucket_exchange>(std::make_unique<shm_exchange>(buckets, std::move(shm), w));
}

std::unique_ptr<bucket_exchange> make_shm_exchange(std::vector<exchange_bucket>& buckets, std::shared_ptr<shm_group> shm,
                                                   const exchange_waits& w) {
  return std::make_unique<shm_exchange>(buckets, std::move(shm), w);
}

std::unique_ptr<bucket_exchange> make_hierarchical_exchange(std::vector<exchange_bucket>& buckets, std::shared_ptr<shm_group> shm,
                                                            std::unique_ptr<bucket_exchange> across, const exchange_waits& w) {
  return std::make_unique<hierarchical_exchange>(buckets, std::move(shm), std::move(across), w);
}

}  // namespace dtactor
