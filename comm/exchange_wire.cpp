// The wire transports of gradient buckets, on a c10d process group:
// fp32 allreduce, and the bf16 wire (all-gather at 2 ranks, reduce-scatter
// + all-gather from 3). See exchange.hpp for the contract.
#include "comm/communicator.hpp"
#include "comm/exchange.hpp"

namespace dtactor {

namespace {

int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(exchange_clock::now().time_since_epoch()).count(); }

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// What every wire transport shares: the group, one work per bucket, and
// waiting for it.
class pg_exchange : public bucket_exchange {
 public:
  pg_exchange(std::vector<exchange_bucket>& buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_waits& w,
              std::string what)
      : bucket_exchange(buckets), pg_(std::move(pg)), waits_(w), what_(std::move(what)), works_(buckets.size()) {}

  const char* label_stem() const override { return ": allreduce of gradient bucket "; }

 protected:
  // Runs `issue` (which returns the bucket's work) and marks the bucket done
  // when that work completes; an exception becomes the step's error.
  template <class F>
  status issue(size_t b, const std::string& what, F&& f) {
    try {
      works_[b] = f();
      auto done = buckets_[b].done_ns;
      works_[b]->getFuture()->addCallback([done](c10::ivalue::Future&) { done->store(now_ns()); });
      return {};
    } catch (const std::exception& e) {
      // Raised on the backward thread inside a hook: the reducer keeps it for finish().
      return make_error(what + " of gradient bucket " + std::to_string(b) + " could not start: " + first_line(e.what()));
    }
  }
  status allreduce(size_t b) {
    return issue(b, what_, [&] {
      std::vector<at::Tensor> t{buckets_[b].flat};
      return pg_->allreduce(t);
    });
  }
  status wait_work(size_t b, exchange_clock::time_point deadline) {
    auto w = std::move(works_[b]);
    return dtactor::wait_work(w, deadline, waits_.abandon, buckets_[b].label, waits_.spin);
  }
  int world() const { return pg_->getSize(); }
  // Every rank's `in` gathered into `all`, in rank order (the gather transports).
  status allgather(size_t b, torch::Tensor& in, std::vector<torch::Tensor>& all) {
    return issue(b, what_, [&] {
      std::vector<std::vector<at::Tensor>> out{all};
      std::vector<at::Tensor> v{in};
      return pg_->allgather(out, v);
    });
  }
  // Bucket b's control words, exactly (fp32), into `dst` (a message's fp32 view).
  static void pack_control(const exchange_bucket& b, const torch::Tensor& dst) {
    if (b.control_words() > 0) dst.copy_(b.flat.narrow(0, b.grads, b.control_words()));
  }
  // Rank r's control words (`words`, fp32) summed in rank order into bucket b's tail.
  static void sum_control(exchange_bucket& b, const torch::Tensor& words, size_t r) {
    if (b.control_words() == 0) return;
    auto tail = b.flat.narrow(0, b.grads, b.control_words());
    if (r == 0)
      tail.copy_(words);
    else
      tail.add_(words);
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  exchange_waits waits_;
  std::string what_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

// fp32 (or the bucket's dtype) SUM allreduce.
class allreduce_exchange final : public pg_exchange {
 public:
  using pg_exchange::pg_exchange;
  status start(size_t b) override {
    buckets_[b].mark_launched();
    return allreduce(b);
  }
  status wait(size_t b, exchange_clock::time_point deadline) override { return wait_work(b, deadline); }
};

bool on_bf16_wire(const exchange_bucket& b) { return b.flat.scalar_type() == torch::kFloat; }  // other dtypes go as they are

// bf16 at 2 ranks: each rank's bucket as bf16 (padded to 4 bytes, then the
// control words in fp32; as kHalf, a type Gloo moves) is all-gathered, and
// every rank sums the world's buckets itself, in fp32 and in rank order
// (bit-identical on every rank; one rounding per rank's gradient, none in
// the sum): half a ring allreduce's bytes at 2 ranks.
class bf16_gather_exchange final : public pg_exchange {
 public:
  bf16_gather_exchange(std::vector<exchange_bucket>& buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_waits& w,
                       std::string what)
      : pg_exchange(buckets, std::move(pg), w, std::move(what)), msg_(buckets.size()) {
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      const auto& b = buckets_[bi];
      if (!on_bf16_wire(b)) continue;
      auto& m = msg_[bi];
      m.ctrl_at = (b.grads + 1) / 2 * 2;
      const int64_t halves = m.ctrl_at + 2 * b.control_words();
      m.in = torch::zeros({halves}, torch::kHalf);
      for (int r = 0; r < world(); ++r) m.all.push_back(torch::zeros({halves}, torch::kHalf));
    }
  }
  status start(size_t bi) override {
    auto& b = buckets_[bi];
    b.mark_launched();
    if (!on_bf16_wire(b)) return allreduce(bi);
    auto& m = msg_[bi];
    {
      torch::NoGradGuard no_grad;
      m.in.narrow(0, 0, b.grads).view(torch::kBFloat16).copy_(b.flat.narrow(0, 0, b.grads));
      pack_control(b, m.in.narrow(0, m.ctrl_at, 2 * b.control_words()).view(torch::kFloat));
    }
    return allgather(bi, m.in, m.all);
  }
  status wait(size_t bi, exchange_clock::time_point deadline) override {
    if (auto st = wait_work(bi, deadline); !st) return st;
    auto& b = buckets_[bi];
    if (!on_bf16_wire(b)) return {};
    torch::NoGradGuard no_grad;
    auto grads = b.flat.narrow(0, 0, b.grads);
    const int64_t ctrl = b.control_words();
    // Rank order on every rank: bit-identical sums everywhere, in fp32.
    const auto& all = msg_[bi].all;
    for (size_t r = 0; r < all.size(); ++r) {
      // Mixed-dtype copy_/add_ widen bf16 to fp32 on the fly: no temporary per rank.
      auto g = all[r].narrow(0, 0, b.grads).view(torch::kBFloat16);
      if (r == 0) grads.copy_(g);
      else grads.add_(g);
      sum_control(b, all[r].narrow(0, msg_[bi].ctrl_at, 2 * ctrl).view(torch::kFloat), r);
    }
    return {};
  }

 private:
  struct message {
    torch::Tensor in;
    std::vector<torch::Tensor> all;
    int64_t ctrl_at = 0;  // where the control words start (halves)
  };
  std::vector<message> msg_;
};

// bf16 from 3 ranks on (where all-gathering whole buckets would cost as
// much as fp32 or more), a reduce-scatter then an all-gather: the message
// holds one chunk per rank (a shard of `shard` bf16 gradients, then the
// control words in fp32); an all-to-all gives each rank every rank's chunk
// of its shard; it sums them in fp32 in rank order, rounds its shard to
// bf16 once and all-gathers the shards. Half a ring allreduce's bytes at
// any size; control words exact (each chunk carries its sender's).
class bf16_scatter_exchange final : public pg_exchange {
 public:
  bf16_scatter_exchange(std::vector<exchange_bucket>& buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_waits& w,
                        std::string what)
      : pg_exchange(buckets, std::move(pg), w, std::move(what)), msg_(buckets.size()) {
    const int64_t n = world();
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      const auto& b = buckets_[bi];
      if (!on_bf16_wire(b)) continue;
      auto& m = msg_[bi];
      // Shards of an even number of halves keep every chunk's control words 4-byte aligned.
      m.shard = ((b.grads + n - 1) / n + 1) / 2 * 2;
      m.chunk = m.shard + 2 * b.control_words();
      m.in = torch::zeros({n * m.chunk}, torch::kHalf);
      m.out = torch::zeros({n * m.chunk}, torch::kHalf);
      m.mine = torch::zeros({m.shard}, torch::kHalf);
      m.sum = torch::zeros({m.shard}, torch::kFloat);
      for (int64_t r = 0; r < n; ++r) m.all.push_back(torch::zeros({m.shard}, torch::kHalf));
    }
  }
  status start(size_t bi) override {
    auto& b = buckets_[bi];
    b.mark_launched();
    if (!on_bf16_wire(b)) return allreduce(bi);
    auto& m = msg_[bi];
    {
      torch::NoGradGuard no_grad;
      const int64_t ctrl = b.control_words();
      for (int64_t r = 0; r < world(); ++r) {
        auto c = m.in.narrow(0, r * m.chunk, m.chunk);
        const int64_t from = r * m.shard, n = std::min(m.shard, b.grads - from);
        if (n > 0) c.narrow(0, 0, n).view(torch::kBFloat16).copy_(b.flat.narrow(0, from, n));  // the padding stays zero
        if (ctrl > 0) c.narrow(0, m.shard, 2 * ctrl).view(torch::kFloat).copy_(b.flat.narrow(0, b.grads, ctrl));
      }
    }
    return issue(bi, what_, [&] {
      std::vector<int64_t> equal_splits;  // empty: equal parts
      return pg_->alltoall_base(m.out, m.in, equal_splits, equal_splits);
    });
  }
  // Every bucket's all-to-all was started (in bucket order, like every
  // rank); now each one's shard is summed and its all-gather started, in
  // bucket order again, so the group sees the same sequence of collectives
  // on every rank.
  status flush(exchange_clock::time_point deadline) override {
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      if (!on_bf16_wire(buckets_[bi])) continue;
      if (auto st = wait_work(bi, deadline); !st) return st;
      if (auto st = reduce_shard(bi); !st) return st;
    }
    return {};
  }
  status wait(size_t bi, exchange_clock::time_point deadline) override {
    if (auto st = wait_work(bi, deadline); !st) return st;
    auto& b = buckets_[bi];
    if (!on_bf16_wire(b)) return {};
    torch::NoGradGuard no_grad;
    // The world's rounded shards, end to end (the control words were summed by reduce_shard).
    auto grads = b.flat.narrow(0, 0, b.grads);
    const auto& m = msg_[bi];
    for (size_t r = 0; r < m.all.size(); ++r) {
      const int64_t from = static_cast<int64_t>(r) * m.shard;
      const int64_t n = std::min(m.shard, b.grads - from);
      if (n <= 0) break;
      grads.narrow(0, from, n).copy_(m.all[r].narrow(0, 0, n).view(torch::kBFloat16));
    }
    return {};
  }

 private:
  status reduce_shard(size_t bi) {
    auto& b = buckets_[bi];
    auto& m = msg_[bi];
    const int64_t ctrl = b.control_words();
    {
      torch::NoGradGuard no_grad;
      // Every rank's chunk of this rank's shard, summed in fp32 in rank
      // order, and rounded to bf16 once: the shard everyone receives.
      for (size_t r = 0; r < m.all.size(); ++r) {
        auto c = m.out.narrow(0, static_cast<int64_t>(r) * m.chunk, m.chunk);
        auto g = c.narrow(0, 0, m.shard).view(torch::kBFloat16);
        if (r == 0) m.sum.copy_(g);
        else m.sum.add_(g);
        if (ctrl > 0) {
          auto w = c.narrow(0, m.shard, 2 * ctrl).view(torch::kFloat);
          if (r == 0) b.flat.narrow(0, b.grads, ctrl).copy_(w);
          else b.flat.narrow(0, b.grads, ctrl).add_(w);
        }
      }
      m.mine.view(torch::kBFloat16).copy_(m.sum);
    }
    return issue(bi, "all-gather of the reduced shards", [&] {
      std::vector<std::vector<at::Tensor>> out{m.all};
      std::vector<at::Tensor> in{m.mine};
      return pg_->allgather(out, in);
    });
  }

  struct message {
    torch::Tensor in, out, mine, sum;
    std::vector<torch::Tensor> all;
    int64_t shard = 0, chunk = 0;  // halves
  };
  std::vector<message> msg_;
};

// train.zero = 2: a reduce-scatter built from an all-to-all (LibTorch 1.13's
// Gloo group has none). Each rank sends every rank the pieces of the bucket
// that rank keeps (its shards, replicas included: kept_by) and the control
// words; each rank sums what it receives in rank order, in fp32, and writes
// the sums into its own pieces of the flat tensor. With the bf16 wire the
// pieces travel as bf16 (control words fp32) and, from 3 ranks on, the sum
// is rounded to bf16 once, as the bf16 scatter exchange does: zero=2 then
// equals zero=0 bit for bit. Bytes a rank sends per bucket: what the other
// ranks keep of it (R/W of the bucket each with R holders a shard).
class zero_scatter_exchange final : public pg_exchange {
 public:
  zero_scatter_exchange(std::vector<exchange_bucket>& buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg, bool bf16, const exchange_waits& w)
      : pg_exchange(buckets, std::move(pg), w, "reduce-scatter"), bf16_(bf16), msg_(buckets.size()) {}
  const char* label_stem() const override { return ": reduce-scatter of gradient bucket "; }
  bool waits_early() const override { return true; }

  status start(size_t bi) override {
    auto& b = buckets_[bi];
    b.mark_launched();
    auto& m = msg_[bi];
    const int n = world(), me = pg_->getRank();
    const bool half = bf16_ && on_bf16_wire(b);
    const int64_t ctrl = b.control_words();
    // A chunk per destination: its pieces end to end (bf16: padded to an
    // even count of halves), then the control words; never empty.
    auto chunk_of = [&](int j, int64_t* kept) {
      int64_t k = 0;
      for (const auto& [off, len] : b.kept_by[static_cast<size_t>(j)]) k += len;
      if (kept) *kept = k;
      const int64_t c = half ? (k + 1) / 2 * 2 + 2 * ctrl : k + ctrl;
      return std::max<int64_t>(c, 1);
    };
    m.half = half;
    m.out_splits.assign(static_cast<size_t>(n), 0);
    int64_t total = 0;
    for (int j = 0; j < n; ++j) total += m.out_splits[static_cast<size_t>(j)] = chunk_of(j, nullptr);
    m.chunk = chunk_of(me, &m.kept);
    m.in_splits.assign(static_cast<size_t>(n), m.chunk);
    const auto dtype = half ? torch::kHalf : b.flat.scalar_type();
    m.send = torch::zeros({total}, torch::TensorOptions(dtype));
    m.recv = torch::empty({n * m.chunk}, torch::TensorOptions(dtype));
    {
      torch::NoGradGuard no_grad;
      int64_t at = 0;
      for (int j = 0; j < n; ++j) {
        auto c = m.send.narrow(0, at, m.out_splits[static_cast<size_t>(j)]);
        int64_t pos = 0;
        for (const auto& [off, len] : b.kept_by[static_cast<size_t>(j)]) {
          auto src = b.flat.narrow(0, off, len);
          if (half)
            c.narrow(0, pos, len).view(torch::kBFloat16).copy_(src);
          else
            c.narrow(0, pos, len).copy_(src);
          pos += len;
        }
        if (ctrl > 0) {
          auto words = b.flat.narrow(0, b.grads, ctrl);
          if (half)
            c.narrow(0, (pos + 1) / 2 * 2, 2 * ctrl).view(torch::kFloat).copy_(words);
          else
            c.narrow(0, pos, ctrl).copy_(words);
        }
        at += m.out_splits[static_cast<size_t>(j)];
      }
    }
    return issue(bi, what_, [&] { return pg_->alltoall_base(m.recv, m.send, m.in_splits, m.out_splits); });
  }

  status wait(size_t bi, exchange_clock::time_point deadline) override {
    if (auto st = wait_work(bi, deadline); !st) return st;
    auto& b = buckets_[bi];
    auto& m = msg_[bi];
    const int n = world(), me = pg_->getRank();
    const int64_t ctrl = b.control_words();
    {
      torch::NoGradGuard no_grad;
      // Every rank's chunk of this rank's pieces, summed in rank order.
      auto sum = torch::empty({m.kept}, torch::TensorOptions(m.half ? torch::kFloat : b.flat.scalar_type()));
      const int64_t ctrl_at = m.half ? (m.kept + 1) / 2 * 2 : m.kept;
      for (int r = 0; r < n; ++r) {
        auto c = m.recv.narrow(0, r * m.chunk, m.chunk);
        auto g = m.half ? c.narrow(0, 0, m.kept).view(torch::kBFloat16) : c.narrow(0, 0, m.kept);
        if (r == 0) sum.copy_(g);
        else sum.add_(g);
        if (ctrl > 0) {
          auto w = m.half ? c.narrow(0, ctrl_at, 2 * ctrl).view(torch::kFloat) : c.narrow(0, ctrl_at, ctrl);
          if (r == 0) b.flat.narrow(0, b.grads, ctrl).copy_(w);
          else b.flat.narrow(0, b.grads, ctrl).add_(w);
        }
      }
      if (m.half && n >= 3) sum.copy_(sum.to(torch::kBFloat16));
      int64_t pos = 0;
      for (const auto& [off, len] : b.kept_by[static_cast<size_t>(me)]) {
        b.flat.narrow(0, off, len).copy_(sum.narrow(0, pos, len));
        pos += len;
      }
    }
    m.send = m.recv = torch::Tensor();  // nothing held between steps
    return {};
  }

 private:
  struct message {
    torch::Tensor send, recv;
    std::vector<int64_t> out_splits, in_splits;
    int64_t chunk = 0;  // what each rank sends this rank
    int64_t kept = 0;   // gradient elements this rank keeps of the bucket
    bool half = false;
  };
  bool bf16_;
  std::vector<message> msg_;
};

}  // namespace

void exchange_bucket::mark_launched() {
  done_ns->store(0);
  launched_at = exchange_clock::now();
}

void exchange_bucket::mark_done() const { done_ns->store(now_ns()); }

std::unique_ptr<bucket_exchange> make_zero_scatter_exchange(std::vector<exchange_bucket>& buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                            bool bf16, const exchange_waits& w) {
  return std::make_unique<zero_scatter_exchange>(buckets, std::move(pg), bf16, w);
}

// int8 or int4 with a per-block scale (cluster.wire_dtype = "int8" /
// "int4", DiLoCo's pseudo-gradients only): each rank quantizes its bucket
// in blocks (int8: 256 values, scale = the block's largest magnitude / 127;
// int4: 64 values, scale = largest / 7, two values a byte), values rounded
// to the nearest step; the ranks all-gather [values | fp32 scales | fp32
// control words], and every rank sums the world's dequantized buckets in
// fp32 and in rank order (bit-identical on every rank). int8 sends 1.016
// bytes a value, int4 0.5625 (a quarter and a seventh of fp32) at 2 ranks;
// it is an all-gather: each rank receives every other rank's message, so
// from 5 ranks on it sends more than a ring's 2x.
class quant_gather_exchange final : public pg_exchange {
 public:
  quant_gather_exchange(std::vector<exchange_bucket>& buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_waits& w,
                        std::string what, int bits)
      : pg_exchange(buckets, std::move(pg), w, std::move(what)), msg_(buckets.size()), bits_(bits) {
    block_ = bits_ == 4 ? int4_block : int8_block;
    levels_ = bits_ == 4 ? 7.0 : 127.0;
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      const auto& b = buckets_[bi];
      if (!on_bf16_wire(b)) continue;
      auto& m = msg_[bi];
      m.blocks = (b.grads + block_ - 1) / block_;
      const int64_t value_bytes = bits_ == 4 ? m.blocks * block_ / 2 : b.grads;  // int4: whole blocks, two a byte
      m.scales_at = (value_bytes + 3) / 4 * 4;
      m.ctrl_at = m.scales_at + 4 * m.blocks;
      const int64_t bytes = m.ctrl_at + 4 * b.control_words();
      m.in = torch::zeros({bytes}, torch::kChar);
      for (int r = 0; r < world(); ++r) m.all.push_back(torch::zeros({bytes}, torch::kChar));
      m.padded = torch::zeros({m.blocks * block_}, torch::kFloat);
    }
  }
  status start(size_t bi) override {
    auto& b = buckets_[bi];
    b.mark_launched();
    if (!on_bf16_wire(b)) return allreduce(bi);
    auto& m = msg_[bi];
    {
      torch::NoGradGuard no_grad;
      m.padded.narrow(0, 0, b.grads).copy_(b.flat.narrow(0, 0, b.grads));
      auto x = m.padded.view({m.blocks, block_});
      auto scale = x.abs().amax(1).div_(levels_);
      auto inv = torch::where(scale > 0, scale.reciprocal(), torch::zeros_like(scale));
      auto q = x.mul(inv.unsqueeze(1)).round_().clamp_(-levels_, levels_).reshape({-1});
      if (bits_ == 4) {
        // 1..15 (q + 8), two a byte: the even value low, the odd one high.
        auto u = q.add(8).to(torch::kShort).view({-1, 2});
        auto packed = u.select(1, 0).add(u.select(1, 1).mul(16));
        m.in.narrow(0, 0, packed.numel()).copy_(packed.to(torch::kByte).view(torch::kChar));
      } else {
        m.in.narrow(0, 0, b.grads).copy_(q.to(torch::kChar).narrow(0, 0, b.grads));
      }
      m.in.narrow(0, m.scales_at, 4 * m.blocks).view(torch::kFloat).copy_(scale);
      pack_control(b, m.in.narrow(0, m.ctrl_at, 4 * b.control_words()).view(torch::kFloat));
    }
    return allgather(bi, m.in, m.all);
  }
  status wait(size_t bi, exchange_clock::time_point deadline) override {
    if (auto st = wait_work(bi, deadline); !st) return st;
    auto& b = buckets_[bi];
    if (!on_bf16_wire(b)) return {};
    torch::NoGradGuard no_grad;
    auto& m = msg_[bi];
    auto grads = b.flat.narrow(0, 0, b.grads);
    const int64_t ctrl = b.control_words();
    for (size_t r = 0; r < m.all.size(); ++r) {
      auto x = m.padded.view({m.blocks, block_});
      if (bits_ == 4) {
        auto packed = m.all[r].narrow(0, 0, m.blocks * block_ / 2).view(torch::kByte).to(torch::kShort);
        auto hi = packed.div(16, "floor");
        auto lo = packed.sub(hi.mul(16));
        m.padded.view({-1, 2}).select(1, 0).copy_(lo.sub(8));
        m.padded.view({-1, 2}).select(1, 1).copy_(hi.sub(8));
      } else {
        m.padded.narrow(0, 0, b.grads).copy_(m.all[r].narrow(0, 0, b.grads));
        if (b.grads < m.blocks * block_) m.padded.narrow(0, b.grads, m.blocks * block_ - b.grads).zero_();
      }
      x.mul_(m.all[r].narrow(0, m.scales_at, 4 * m.blocks).view(torch::kFloat).unsqueeze(1));
      if (r == 0) grads.copy_(m.padded.narrow(0, 0, b.grads));
      else grads.add_(m.padded.narrow(0, 0, b.grads));
      sum_control(b, m.all[r].narrow(0, m.ctrl_at, 4 * ctrl).view(torch::kFloat), r);
    }
    return {};
  }

 private:
  struct message {
    torch::Tensor in, padded;
    std::vector<torch::Tensor> all;
    int64_t blocks = 0, scales_at = 0, ctrl_at = 0;  // bytes
  };
  std::vector<message> msg_;
  int bits_ = 8;
  int64_t block_ = int8_block;
  double levels_ = 127.0;
};

std::unique_ptr<bucket_exchange> make_wire_exchange(std::vector<exchange_bucket>& buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                    wire_format f, const exchange_waits& w, std::string what) {
  if (f == wire_format::int8 || f == wire_format::int4)
    return std::make_unique<quant_gather_exchange>(buckets, std::move(pg), w, std::move(what), f == wire_format::int4 ? 4 : 8);
  const bool bf16 = f == wire_format::bf16;
  if (!bf16) return std::make_unique<allreduce_exchange>(buckets, std::move(pg), w, std::move(what));
  if (pg->getSize() >= 3) return std::make_unique<bf16_scatter_exchange>(buckets, std::move(pg), w, std::move(what));
  return std::make_unique<bf16_gather_exchange>(buckets, std::move(pg), w, std::move(what));
}

}  // namespace dtactor
