// The wire transports of gradient buckets, on a c10d process group: fp32
// allreduce, and a codec's exchange (the registry's, exchange_registry.hpp:
// an all-gather of every rank's encoded bucket, or a reduce-scatter and an
// all-gather of the encoded shards), and ZeRO-2's reduce-scatter. See
// exchange.hpp for the contract.
#include "comm/communicator.hpp"
#include "comm/exchange.hpp"
#include "comm/exchange_registry.hpp"

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

// A float32 bucket goes through the codec; other dtypes go as they are.
bool coded(const exchange_bucket& b) { return b.flat.scalar_type() == torch::kFloat; }

// What every codec's exchange shares (DDP's compression wrapper around a
// hook): a bucket a codec does not take is allreduced as it is; a coded
// one is encoded, moved and decoded by the pattern below it. Control words
// travel exactly (fp32) after the encoded values.
class coded_exchange : public pg_exchange {
 public:
  coded_exchange(std::vector<exchange_bucket>& buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_waits& w, std::string what,
                 std::unique_ptr<bucket_codec> codec)
      : pg_exchange(buckets, std::move(pg), w, std::move(what)), codec_(std::move(codec)) {}
  status start(size_t b) final {
    buckets_[b].mark_launched();
    if (!coded(buckets_[b])) return allreduce(b);
    torch::NoGradGuard no_grad;
    return start_coded(b);
  }
  status wait(size_t b, exchange_clock::time_point deadline) final {
    if (auto st = wait_work(b, deadline); !st) return st;
    if (!coded(buckets_[b])) return {};
    torch::NoGradGuard no_grad;
    finish_coded(b);
    return {};
  }

 protected:
  // Packs bucket b's message and starts its first collective.
  virtual status start_coded(size_t b) = 0;
  // Its last collective completed: the world's sum into its flat tensor.
  virtual void finish_coded(size_t b) = 0;
  // `n` fp32 control words at byte `at` of a kChar message.
  static torch::Tensor words_at(const torch::Tensor& msg, int64_t at, int64_t n) { return msg.narrow(0, at, 4 * n).view(torch::kFloat); }

  std::unique_ptr<bucket_codec> codec_;
};

// Every rank's encoded bucket [values | control words] is all-gathered and
// every rank decodes and sums the world's, in fp32 and in rank order
// (bit-identical on every rank; one rounding per rank's gradient, none in
// the sum). bf16 at 2 ranks: half a ring allreduce's bytes.
class gather_exchange final : public coded_exchange {
 public:
  gather_exchange(std::vector<exchange_bucket>& buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_waits& w, std::string what,
                  std::unique_ptr<bucket_codec> codec)
      : coded_exchange(buckets, std::move(pg), w, std::move(what), std::move(codec)), msg_(buckets.size()) {
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      const auto& b = buckets_[bi];
      if (!coded(b)) continue;
      auto& m = msg_[bi];
      m.ctrl_at = codec_->bytes(b.grads);
      const int64_t bytes = m.ctrl_at + 4 * b.control_words();
      m.in = torch::zeros({bytes}, torch::kChar);
      for (int r = 0; r < world(); ++r) m.all.push_back(torch::zeros({bytes}, torch::kChar));
    }
  }

 private:
  status start_coded(size_t bi) override {
    auto& b = buckets_[bi];
    auto& m = msg_[bi];
    codec_->encode(b.flat.narrow(0, 0, b.grads), m.in);
    pack_control(b, words_at(m.in, m.ctrl_at, b.control_words()));
    return allgather(bi, m.in, m.all);
  }
  void finish_coded(size_t bi) override {
    auto& b = buckets_[bi];
    const auto& m = msg_[bi];
    auto grads = b.flat.narrow(0, 0, b.grads);
    for (size_t r = 0; r < m.all.size(); ++r) {
      codec_->decode(m.all[r], grads, r > 0);
      sum_control(b, words_at(m.all[r], m.ctrl_at, b.control_words()), r);
    }
  }

  struct message {
    torch::Tensor in;
    std::vector<torch::Tensor> all;
    int64_t ctrl_at = 0;  // bytes
  };
  std::vector<message> msg_;
};

// A reduce-scatter then an all-gather (bf16 from 3 ranks on, where
// all-gathering whole buckets would cost as much as fp32 or more): the
// message holds one chunk per rank (rank r's shard of the values, encoded,
// then the control words in fp32); an all-to-all gives each rank every
// rank's chunk of its shard; it decodes and sums them in fp32 in rank
// order, encodes its shard's sum once and all-gathers the encoded shards.
// Half a ring allreduce's bytes at any size for bf16; control words exact
// (each chunk carries its sender's).
class scatter_exchange final : public coded_exchange {
 public:
  scatter_exchange(std::vector<exchange_bucket>& buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_waits& w, std::string what,
                   std::unique_ptr<bucket_codec> codec)
      : coded_exchange(buckets, std::move(pg), w, std::move(what), std::move(codec)), msg_(buckets.size()) {
    const int64_t n = world();
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      const auto& b = buckets_[bi];
      if (!coded(b)) continue;
      auto& m = msg_[bi];
      m.shard = (b.grads + n - 1) / n;
      m.shard_bytes = codec_->bytes(m.shard);
      m.chunk = m.shard_bytes + 4 * b.control_words();
      m.in = torch::zeros({n * m.chunk}, torch::kChar);
      m.out = torch::zeros({n * m.chunk}, torch::kChar);
      m.mine = torch::zeros({m.shard_bytes}, torch::kChar);
      m.sum = torch::zeros({m.shard}, torch::kFloat);
      for (int64_t r = 0; r < n; ++r) m.all.push_back(torch::zeros({m.shard_bytes}, torch::kChar));
    }
  }
  // Every bucket's all-to-all was started (in bucket order, like every
  // rank); now each one's shard is summed and its all-gather started, in
  // bucket order again, so the group sees the same sequence of collectives
  // on every rank.
  status flush(exchange_clock::time_point deadline) override {
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      if (!coded(buckets_[bi])) continue;
      if (auto st = wait_work(bi, deadline); !st) return st;
      if (auto st = reduce_shard(bi); !st) return st;
    }
    return {};
  }

 private:
  struct message {
    torch::Tensor in, out, mine, sum;
    std::vector<torch::Tensor> all;
    int64_t shard = 0, shard_bytes = 0, chunk = 0;  // values, bytes, bytes
    // Values of rank r's shard (the last ones may be short or empty).
    int64_t count(int64_t r, int64_t grads) const { return std::clamp<int64_t>(grads - r * shard, 0, shard); }
  };

  status start_coded(size_t bi) override {
    auto& b = buckets_[bi];
    auto& m = msg_[bi];
    const int64_t ctrl = b.control_words();
    for (int64_t r = 0; r < world(); ++r) {
      auto c = m.in.narrow(0, r * m.chunk, m.chunk);
      if (const int64_t k = m.count(r, b.grads); k > 0) codec_->encode(b.flat.narrow(0, r * m.shard, k), c);
      if (ctrl > 0) words_at(c, m.shard_bytes, ctrl).copy_(b.flat.narrow(0, b.grads, ctrl));
    }
    return issue(bi, what_, [&] {
      std::vector<int64_t> equal_splits;  // empty: equal parts
      return pg_->alltoall_base(m.out, m.in, equal_splits, equal_splits);
    });
  }
  void finish_coded(size_t bi) override {
    // The world's encoded shards, end to end (the control words were summed by reduce_shard).
    auto& b = buckets_[bi];
    const auto& m = msg_[bi];
    for (size_t r = 0; r < m.all.size(); ++r) {
      const int64_t k = m.count(static_cast<int64_t>(r), b.grads);
      if (k <= 0) break;
      codec_->decode(m.all[r], b.flat.narrow(0, static_cast<int64_t>(r) * m.shard, k), false);
    }
  }
  status reduce_shard(size_t bi) {
    auto& b = buckets_[bi];
    auto& m = msg_[bi];
    const int64_t ctrl = b.control_words();
    {
      torch::NoGradGuard no_grad;
      // Every rank's chunk of this rank's shard, summed in fp32 in rank
      // order, and encoded once: the shard everyone receives.
      auto sum = m.sum.narrow(0, 0, m.count(pg_->getRank(), b.grads));
      for (size_t r = 0; r < m.all.size(); ++r) {
        auto c = m.out.narrow(0, static_cast<int64_t>(r) * m.chunk, m.chunk);
        if (sum.numel() > 0) codec_->decode(c, sum, r > 0);
        sum_control(b, words_at(c, m.shard_bytes, ctrl), r);
      }
      if (sum.numel() > 0) codec_->encode(sum, m.mine);
    }
    return issue(bi, "all-gather of the reduced shards", [&] {
      std::vector<std::vector<at::Tensor>> out{m.all};
      std::vector<at::Tensor> in{m.mine};
      return pg_->allgather(out, in);
    });
  }

  std::vector<message> msg_;
};

// train.zero = 2: a reduce-scatter built from an all-to-all (LibTorch 1.13's
// Gloo group has none). Each rank sends every rank the pieces of the bucket
// that rank keeps (its shards, replicas included: kept_by) and the control
// words; each rank sums what it receives in rank order, in fp32, and writes
// the sums into its own pieces of the flat tensor. With a codec the pieces
// travel encoded (control words fp32) and, where the codec's own exchange
// would reduce-scatter (bf16 from 3 ranks on), the sum is encoded and
// decoded once more, as that exchange rounds it: zero=2 then equals zero=0
// bit for bit. Bytes a rank sends per bucket: what the other ranks keep of
// it (R/W of the bucket each with R holders a shard).
class zero_scatter_exchange final : public pg_exchange {
 public:
  zero_scatter_exchange(std::vector<exchange_bucket>& buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::unique_ptr<bucket_codec> codec,
                        bool round_sum, const exchange_waits& w)
      : pg_exchange(buckets, std::move(pg), w, "reduce-scatter"), codec_(std::move(codec)), round_sum_(round_sum), msg_(buckets.size()) {}
  const char* label_stem() const override { return ": reduce-scatter of gradient bucket "; }
  bool waits_early() const override { return true; }

  status start(size_t bi) override {
    auto& b = buckets_[bi];
    b.mark_launched();
    auto& m = msg_[bi];
    const int n = world(), me = pg_->getRank();
    m.coded = codec_ && coded(b);
    m.out_splits.assign(static_cast<size_t>(n), 0);
    int64_t total = 0;
    for (int j = 0; j < n; ++j) total += m.out_splits[static_cast<size_t>(j)] = chunk_of(b, m.coded, j, nullptr);
    m.chunk = chunk_of(b, m.coded, me, &m.kept);
    m.in_splits.assign(static_cast<size_t>(n), m.chunk);
    const auto dtype = m.coded ? torch::kChar : b.flat.scalar_type();
    m.send = torch::zeros({total}, torch::TensorOptions(dtype));
    m.recv = torch::empty({n * m.chunk}, torch::TensorOptions(dtype));
    {
      torch::NoGradGuard no_grad;
      int64_t at = 0;
      for (int j = 0; j < n; ++j) {
        pack_for(b, m, j, m.send.narrow(0, at, m.out_splits[static_cast<size_t>(j)]));
        at += m.out_splits[static_cast<size_t>(j)];
      }
    }
    return issue(bi, what_, [&] { return pg_->alltoall_base(m.recv, m.send, m.in_splits, m.out_splits); });
  }

  status wait(size_t bi, exchange_clock::time_point deadline) override {
    if (auto st = wait_work(bi, deadline); !st) return st;
    auto& b = buckets_[bi];
    auto& m = msg_[bi];
    {
      torch::NoGradGuard no_grad;
      auto sum = sum_received(b, m);
      int64_t pos = 0;
      for (const auto& [off, len] : b.kept_by[static_cast<size_t>(pg_->getRank())]) {
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
    int64_t chunk = 0;  // what each rank sends this rank (bytes when coded, else elements)
    int64_t kept = 0;   // gradient elements this rank keeps of the bucket
    bool coded = false;
  };

  // Where a chunk's control words start: after the values (coded: after
  // their bytes, a multiple of 4).
  int64_t ctrl_at(bool coded_chunk, int64_t kept) const { return coded_chunk ? codec_->bytes(kept) : kept; }
  // Rank j's chunk: its pieces end to end, then the control words; never empty.
  int64_t chunk_of(const exchange_bucket& b, bool coded_chunk, int j, int64_t* kept) const {
    int64_t k = 0;
    for (const auto& [off, len] : b.kept_by[static_cast<size_t>(j)]) k += len;
    if (kept) *kept = k;
    const int64_t words = coded_chunk ? 4 * b.control_words() : b.control_words();
    return std::max<int64_t>(ctrl_at(coded_chunk, k) + words, coded_chunk ? 4 : 1);
  }
  // `pieces` of bucket b end to end at the start of `dst`.
  static void join(const exchange_bucket& b, const std::vector<std::pair<int64_t, int64_t>>& pieces, const torch::Tensor& dst) {
    int64_t pos = 0;
    for (const auto& [off, len] : pieces) {
      dst.narrow(0, pos, len).copy_(b.flat.narrow(0, off, len));
      pos += len;
    }
  }
  // Rank j's pieces of bucket b and the control words into `c`.
  void pack_for(const exchange_bucket& b, const message& m, int j, const torch::Tensor& c) const {
    const auto& pieces = b.kept_by[static_cast<size_t>(j)];
    int64_t k = 0;
    for (const auto& [off, len] : pieces) k += len;
    if (m.coded) {
      // One piece is encoded in place; several are joined first.
      torch::Tensor values = pieces.size() == 1 ? b.flat.narrow(0, pieces[0].first, pieces[0].second) : torch::empty({k}, torch::kFloat);
      if (pieces.size() != 1) join(b, pieces, values);
      codec_->encode(values, c);
    } else {
      join(b, pieces, c);
    }
    const int64_t ctrl = b.control_words();
    if (ctrl == 0) return;
    auto words = b.flat.narrow(0, b.grads, ctrl);
    if (m.coded) c.narrow(0, ctrl_at(true, k), 4 * ctrl).view(torch::kFloat).copy_(words);
    else c.narrow(0, k, ctrl).copy_(words);
  }
  // Every rank's chunk of this rank's pieces, summed in rank order (the
  // control words into the bucket's tail).
  torch::Tensor sum_received(exchange_bucket& b, const message& m) {
    const int n = world();
    const int64_t ctrl = b.control_words(), at = ctrl_at(m.coded, m.kept);
    auto sum = torch::empty({m.kept}, torch::TensorOptions(m.coded ? torch::kFloat : b.flat.scalar_type()));
    for (int r = 0; r < n; ++r) {
      auto c = m.recv.narrow(0, r * m.chunk, m.chunk);
      if (m.coded) codec_->decode(c, sum, r > 0);
      else if (r == 0) sum.copy_(c.narrow(0, 0, m.kept));
      else sum.add_(c.narrow(0, 0, m.kept));
      if (ctrl > 0) {
        auto w = m.coded ? c.narrow(0, at, 4 * ctrl).view(torch::kFloat) : c.narrow(0, at, ctrl);
        if (r == 0) b.flat.narrow(0, b.grads, ctrl).copy_(w);
        else b.flat.narrow(0, b.grads, ctrl).add_(w);
      }
    }
    if (m.coded && round_sum_ && m.kept > 0) {
      auto bytes = torch::empty({codec_->bytes(m.kept)}, torch::kChar);
      codec_->encode(sum, bytes);
      codec_->decode(bytes, sum, false);
    }
    return sum;
  }

  std::unique_ptr<bucket_codec> codec_;  // null: the pieces go as they are
  bool round_sum_;
  std::vector<message> msg_;
};

}  // namespace

void exchange_bucket::mark_launched() {
  done_ns->store(0);
  launched_at = exchange_clock::now();
}

void exchange_bucket::mark_done() const { done_ns->store(now_ns()); }

result<std::unique_ptr<bucket_exchange>> make_zero_scatter_exchange(std::vector<exchange_bucket>& buckets,
                                                                    c10::intrusive_ptr<c10d::ProcessGroup> pg, wire_codec c,
                                                                    const exchange_waits& w) {
  const codec_entry* e = find_codec(c);
  if (!e) return make_error("train.zero = 2: no codec " + name_of(c) + " is registered");
  const bool round_sum = e->make && e->scatter_from > 0 && pg->getSize() >= e->scatter_from;
  return std::unique_ptr<bucket_exchange>(
      std::make_unique<zero_scatter_exchange>(buckets, std::move(pg), e->make ? e->make() : nullptr, round_sum, w));
}

result<std::unique_ptr<bucket_exchange>> make_wire_exchange(std::vector<exchange_bucket>& buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                            wire_codec c, const exchange_waits& w, std::string what) {
  const codec_entry* e = find_codec(c);
  if (!e) return make_error("gradient exchange: no codec " + name_of(c) + " is registered");
  if (what.empty()) what = e->make ? e->name + " exchange" : "allreduce";
  std::unique_ptr<bucket_exchange> out;
  if (!e->make)
    out = std::make_unique<allreduce_exchange>(buckets, std::move(pg), w, std::move(what));
  else if (e->scatter_from > 0 && pg->getSize() >= e->scatter_from)
    out = std::make_unique<scatter_exchange>(buckets, std::move(pg), w, std::move(what), e->make());
  else
    out = std::make_unique<gather_exchange>(buckets, std::move(pg), w, std::move(what), e->make());
  return out;
}

}  // namespace dtactor
