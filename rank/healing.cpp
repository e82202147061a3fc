#include "rank/healing.hpp"

#include <condition_variable>
#include <functional>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/peer_moves.hpp"
#include "model/trainer.hpp"
#include "rank/generation.hpp"
#include "rank/group_builder.hpp"
#include "rank/state_io.hpp"
#include "rank/state_source.hpp"
#include "rank/sync_strategy.hpp"
#include "rank/zero.hpp"

namespace dtactor {

namespace {

constexpr uint64_t heal_chunk_bytes = 64ull << 20;
constexpr size_t heal_in_flight = 4;  // chunks on their way to each receiving rank at once
constexpr int moves_tag_base = 1 << 24;  // the moments' moves, after the state's chunks on the same group

// A piece of the state as the transfer sends it: every layout entry on its
// own, cut in chunks (the same cut on both sides, whatever lies next to it
// in memory), the sender's unstable entries read from copies.
struct piece {
  char* base = nullptr;
  int64_t n = 0;
};

std::vector<piece> pieces_of(const std::vector<torch::Tensor>& tensors) {
  std::vector<piece> out;
  for (const auto& t : tensors) {
    const auto bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    char* base = static_cast<char*>(t.data_ptr());
    for (uint64_t at = 0; at < bytes; at += heal_chunk_bytes)
      out.push_back({base + at, static_cast<int64_t>(std::min<uint64_t>(heal_chunk_bytes, bytes - at))});
  }
  return out;
}

// 63 ranks a word (the sign bit left alone), each rank setting only its own
// bit: a SUM is their OR.
std::vector<int64_t> bit_words(int world) { return std::vector<int64_t>(static_cast<size_t>((world + 62) / 63), 0); }
bool bit_of(const std::vector<int64_t>& w, int r) { return (w[static_cast<size_t>(r / 63)] >> (r % 63)) & 1; }

// Which ranks hold the agreed step: one collective, a bit a rank.
result<std::vector<int64_t>> holders_of(const generation_run& g, bool holds) {
  auto words = bit_words(g.world);
  if (holds) words[static_cast<size_t>(g.rank / 63)] |= int64_t{1} << (g.rank % 63);
  if (auto st = sum_allreduce(*g.pg, words, deadline_in(g.timeout), g.abandon_now, "state agreement (holders)"); !st) return st.err();
  return words;
}

}  // namespace

// The transfer on its own thread: the root sends the state it held when
// the step began to every rank receiving it; a receiving rank takes it in
// place, what a forward reads first. At train.zero >= 1 every rank then
// runs its moves of the optimizer's moments (add_moves). Ended (abandoned,
// joined) with the generation; a receiving rank whose state did not land
// whole is reset to the initial state then.
class heal_transfer {
 public:
  // `copies` (sharded masters: bf16 from zero = 1): the parameters travel
  // as the bf16 copies the module computes with, which every rank holds
  // whole and current, not as the masters, which the root holds only for
  // its shards (each rank's come with its moments: add_moves).
  heal_transfer(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<const local_peers> peers, training_state& state, const generation_run& g,
                std::vector<int> to, int from, bool copies)
      : pg_(std::move(pg)), peers_(std::move(peers)), state_(state), to_(std::move(to)), from_(from), timeout_(g.timeout), outer_abandon_(g.abandon_now) {
    const state_layout layout = layout_of(state_);
    std::map<std::string, torch::Tensor> compute;
    if (copies)
      for (auto& kv : state_.the_task().module()->named_parameters()) compute["model/" + kv.key()] = kv.value().detach();
    // What a forward reads first, on both sides in the same order.
    for (bool first : {true, false})
      for (const auto& e : layout.entries) {
        if (e.sharded || forward_reads(e.name) != first) continue;  // the moments' windows move as add_moves says
        const auto copy = compute.find(e.name);
        const torch::Tensor t = copy != compute.end() ? copy->second : e.t;
        bytes_ += static_cast<uint64_t>(t.numel() * t.element_size());
        names_.push_back(e.name);
        // Sending: what a forward may change travels as it is now.
        tensors_.push_back(sending() && !to_.empty() && !stable_until_update(e.name) ? t.clone() : t);
        if (first) forward_tensors_ = tensors_.size();
      }
  }
  ~heal_transfer() {
    state_.set_update_fence(nullptr);
    {
      std::lock_guard<std::mutex> lock(mu_);
      abort_ = true;
      for (auto& w : issued_) w->abort();  // a send's or receive's wait returns at once
    }
    if (thread_.joinable()) thread_.join();
    // The update never ran: the windows held at the agreed step are whole,
    // what landed in the new ones may not be.
    if (opt_ && !landed_) opt_->restore_retired();
    if (opt_) opt_->keep_compute_once(false);  // a forward that never ran leaves it set
    if (!sending() && !landed_) (void)state_.reset_state();  // torn, or never sent: not the agreed state
  }
  heal_transfer(const heal_transfer&) = delete;
  heal_transfer& operator=(const heal_transfer&) = delete;

  bool sending() const { return from_ < 0; }
  // train.zero >= 1 (plan_reshard, made on the generation's thread): this
  // rank's moves of the moments, run after the state; the update then
  // waits for every rank's (`vote`: one word over the generation's group),
  // so that either every rank updates or none does, and drops the retired
  // windows.
  void add_moves(reshard_plan moves, flat_adamw& opt, c10::intrusive_ptr<c10d::ProcessGroup> vote) {
    moves_ = std::move(moves);
    opt_ = &opt;
    vote_pg_ = std::move(vote);
  }
  // Run at the update, on every rank, once the moves landed everywhere:
  // what had to wait for them (sharded masters: giving back the pages of
  // the masters this rank no longer holds, which it may have sent).
  void after_landing(std::function<void()> f) { after_landing_ = std::move(f); }
  uint64_t bytes() const { return bytes_; }
  int64_t step() const { return step_; }
  void start(int64_t step) {
    step_ = step;
    t0_ = std::chrono::steady_clock::now();
    thread_ = std::thread([this] {
      status st = sending() ? send() : receive();
      if (st && opt_) st = move();
      std::lock_guard<std::mutex> lock(mu_);
      outcome_ = std::move(st);
      ended_ = true;
      cv_.notify_all();
    });
  }
  // A receiving rank, before its forward: the parameters and buffers landed.
  status forward_landed(const std::function<bool()>& abandon) {
    std::unique_lock<std::mutex> lock(mu_);
    while (!forward_landed_ && !ended_) {
      cv_.wait_for(lock, std::chrono::milliseconds(5));
      if (abandon && abandon()) return make_error("state transfer while training abandoned: a newer generation replaces this one");
    }
    if (!forward_landed_) return make_error("state transfer while training: " + outcome_.message());
    forward_s_ = seconds_since_start();
    return {};
  }
  // At the update: the transfer's end. A receiving rank then holds the
  // agreed state; the root goes on whatever became of its send (the
  // receiving rank fails its own step).
  status land() {
    if (thread_.joinable()) thread_.join();
    if (opt_) return land_with_moves();
    const double s = seconds_since_start();
    if (sending()) {
      if (!outcome_) std::fprintf(stderr, "dtactor: healing: sending the state failed: %s\n", outcome_.message().c_str());
      return {};
    }
    if (!outcome_) return make_error("state transfer while training: " + outcome_.message());
    adopt_scalars();
    state_.state_loaded(step_);
    landed_ = true;
    std::fprintf(stderr, "dtactor: healing: %llu bytes of state at step %lld (%llu read from rank %d's memory): parameters and buffers %.3f s, all %.3f s after the transfer began\n",
                 static_cast<unsigned long long>(bytes_), static_cast<long long>(step_), static_cast<unsigned long long>(read_bytes_), from_, forward_s_, s);
    return {};
  }

 private:
  status land_with_moves() {
    const double s = seconds_since_start();
    if (outcome_) {
      opt_->drop_retired();
      if (!sending()) {
        adopt_scalars();
        state_.state_loaded(step_);
      }
      landed_ = true;
    }
    std::vector<int64_t> failed{outcome_ ? 0 : 1};
    if (auto st = sum_allreduce(*vote_pg_, failed, deadline_in(timeout_), outer_abandon_, "state transfer while training (whether every rank has it)"); !st)
      return st;
    if (!outcome_) return make_error("state transfer while training: " + outcome_.message());
    if (failed[0] > 0) return make_error("state transfer while training failed on " + std::to_string(failed[0]) + " other rank(s): no rank updates");
    if (after_landing_) std::exchange(after_landing_, nullptr)();
    std::fprintf(stderr, "dtactor: healing: step %lld: %llu bytes of state in, %llu of optimizer moments in and %llu out, all landed %.3f s after the transfer began\n",
                 static_cast<long long>(step_), static_cast<unsigned long long>(sending() ? 0 : bytes_),
                 static_cast<unsigned long long>(moves_.totals.bytes_in), static_cast<unsigned long long>(moves_.totals.bytes_out), s);
    return {};
  }
  // The moments' sends and receives, all started at once (each sender's
  // windows are retired: nothing changes them until drop_retired).
  status move() {
    if (auto st = run_moves(*pg_, moves_.moves, *peers_, waits()); !st) return make_error("optimizer reshard while training: " + st.message());
    return {};
  }
  p2p_waits waits() {
    return {[this](c10::intrusive_ptr<c10d::Work> w) { return issue(std::move(w)); },
            [this](const c10::intrusive_ptr<c10d::Work>& w, const std::string& what) { return wait(w, what); }};
  }
  static bool forward_reads(const std::string& name) { return name.rfind("model/", 0) == 0 || name.rfind("buffer/", 0) == 0; }
  double seconds_since_start() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count(); }
  // The step counters and the generator arrived in the tensors the layout
  // had when the transfer began; the state reads them from its latest
  // (a layout taken since, by the checkpoint saver, made new ones).
  void adopt_scalars() {
    const state_layout now = layout_of(state_);
    for (size_t i = 0; i < names_.size(); ++i) {
      if (stable_until_update(names_[i])) continue;
      for (const auto& e : now.entries)
        if (e.name == names_[i] && e.t.data_ptr() != tensors_[i].data_ptr()) e.t.copy_(tensors_[i]);
    }
  }
  // Gloo's point-to-point work has no future to poll (wait_work's way):
  // it is waited for with the collective timeout, and the generation's end
  // aborts it (the destructor). `issued_` keeps every piece's work.
  c10::intrusive_ptr<c10d::Work> issue(c10::intrusive_ptr<c10d::Work> w) {
    std::lock_guard<std::mutex> lock(mu_);
    if (abort_) w->abort();
    issued_.push_back(w);
    return w;
  }
  status wait(const c10::intrusive_ptr<c10d::Work>& w, const std::string& what) {
    if (outer_abandon_ && outer_abandon_()) return make_error(what + " abandoned: a newer generation replaces this one");
    bool done = false;
    try {
      done = w->wait(timeout_);
    } catch (const std::exception& e) {
      std::string why = e.what();
      return make_error(what + " failed: " + why.substr(0, why.find('\n')));
    }
    if (!done) return make_error(what + " abandoned: the generation ended");
    return {};
  }
  // The state's pieces to each receiving rank, at most heal_in_flight
  // each on their way (through memory where the receiver reads this
  // rank's: comm/peer_moves).
  status send() {
    std::vector<torch::Tensor> head{torch::tensor({step_, static_cast<int64_t>(bytes_)}, torch::kInt64)};
    for (int r : to_)
      if (auto st = wait(issue(pg_->send(head, r, 0)), "state transfer (header)"); !st) return st;
    peer_moves mv(*pg_, *peers_, waits());
    int tag = 1;
    for (const auto& p : pieces_of(tensors_)) {
      for (int r : to_) mv.send(torch::from_blob(p.base, {p.n}, torch::kUInt8), r, tag);
      ++tag;
      if (auto st = mv.complete_until(heal_in_flight * to_.size()); !st) return with_what(st);
    }
    return with_what(mv.finish());
  }
  status receive() {
    std::vector<torch::Tensor> head{torch::zeros({2}, torch::kInt64)};
    if (auto st = wait(issue(pg_->recv(head, from_, 0)), "state transfer (header)"); !st) return st;
    if (head[0][0].item<int64_t>() != step_ || static_cast<uint64_t>(head[0][1].item<int64_t>()) != bytes_)
      return make_error("rank " + std::to_string(from_) + " sends " + std::to_string(head[0][1].item<int64_t>()) + " bytes of step " +
                        std::to_string(head[0][0].item<int64_t>()) + ", this rank expects " + std::to_string(bytes_) + " of step " +
                        std::to_string(step_) + " (another model?)");
    const std::vector<torch::Tensor> first(tensors_.begin(), tensors_.begin() + static_cast<std::ptrdiff_t>(forward_tensors_));
    const std::vector<torch::Tensor> rest(tensors_.begin() + static_cast<std::ptrdiff_t>(forward_tensors_), tensors_.end());
    peer_moves mv(*pg_, *peers_, waits());
    int tag = 1;
    for (const auto* part : {&first, &rest}) {
      for (const auto& p : pieces_of(*part)) {
        mv.recv(torch::from_blob(p.base, {p.n}, torch::kUInt8), from_, tag++);
        if (auto st = mv.complete_until(heal_in_flight); !st) return with_what(st);
      }
      if (auto st = mv.complete_until(0); !st) return with_what(st);
      if (part == &first) {
        std::lock_guard<std::mutex> lock(mu_);
        forward_landed_ = true;
        cv_.notify_all();
      }
    }
    auto st = mv.finish();
    read_bytes_ = mv.bytes_read();
    return with_what(st);
  }
  static status with_what(status st) { return st ? st : make_error("state transfer: " + st.message()); }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::shared_ptr<const local_peers> peers_;  // who reads whose memory (every rank of pg_)
  training_state& state_;
  std::vector<int> to_;  // sending: the receiving ranks
  int from_ = -1;        // receiving: the root (-1: this rank sends)
  std::chrono::milliseconds timeout_;
  abandon_fn outer_abandon_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> tensors_;  // the layout's entries, what a forward reads first (sending: the unstable ones copied)
  size_t forward_tensors_ = 0;          // of them, what a forward reads
  uint64_t bytes_ = 0;
  uint64_t read_bytes_ = 0;  // receiving: of bytes_, read from the root's memory
  int64_t step_ = -1;
  std::mutex mu_;
  std::condition_variable cv_;
  bool abort_ = false;                                  // mu_
  std::vector<c10::intrusive_ptr<c10d::Work>> issued_;  // mu_
  bool forward_landed_ = false, ended_ = false;         // mu_
  status outcome_;                                      // mu_ until ended_
  std::thread thread_;
  bool landed_ = false;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  double forward_s_ = 0;
  // train.zero >= 1 (add_moves)
  reshard_plan moves_;
  flat_adamw* opt_ = nullptr;
  c10::intrusive_ptr<c10d::ProcessGroup> vote_pg_;
  std::function<void()> after_landing_;
};

namespace {

// Who receives the state (the ranks not holding the agreed step), and the
// transfer started on the root and on each of them; the other holders
// just train.
class healing_state final : public state_source {
 public:
  generation_end take(start_context& c) override {
    generation_run& g = c.g;
    const int64_t agreed = c.agreed.max_step;
    const bool holds = c.rs.sync->held_step(c.state) == agreed;
    auto holders = holders_of(g, holds);
    if (!holders) return g.failed(holders.message(), c.state.step());
    auto pg = transfer_group(g, c.rs);
    if (!pg) return g.failed("state transfer: " + pg.message(), c.state.step());
    auto peers = local_peers_of(g);  // the same ranks as pg's
    if (!peers) return g.failed("state transfer: " + peers.message(), c.state.step());
    std::vector<int> receiving;
    for (int r = 0; r < g.world; ++r)
      if (!bit_of(holders.value(), r)) receiving.push_back(r);
    // At train.zero >= 1 every rank has a transfer: the moments' moves
    // (healing_shards) may send or receive on any of them.
    const bool moves = c.rs.settings.train.zero >= 1;
    const bool copies = masters_sharded(c.rs.settings.train);
    if (g.rank == g.root) {
      g.healing = std::make_shared<heal_transfer>(pg.value(), g.peers, c.state, g, receiving, -1, copies);
    } else if (holds && moves) {
      g.healing = std::make_shared<heal_transfer>(pg.value(), g.peers, c.state, g, std::vector<int>{}, -1, copies);
    } else if (!holds) {
      if (moves) c.state.drop_stale_moments();  // its windows come from the reshard (healing_shards)
      g.healing = std::make_shared<heal_transfer>(pg.value(), g.peers, c.state, g, std::vector<int>{}, g.root, copies);
      c.state.skip_to(agreed);
      g.source = ev::state_source::peer;
      c.rs.disk_step = -1;
      g.transfer_bytes = g.healing->bytes();
      std::fprintf(stderr, "rank %d: generation %llu: healing: %llu bytes of state at step %lld from rank %d while the step trains\n", g.rank,
                   static_cast<unsigned long long>(g.gen), static_cast<unsigned long long>(g.transfer_bytes), static_cast<long long>(agreed),
                   g.root);
    }
    if (g.healing) {
      heal_transfer* t = g.healing.get();
      c.state.set_update_fence([t] { return t->land(); });
      if (!moves) t->start(agreed);  // else once the moves are planned
    }
    return std::nullopt;
  }
};

// train.zero >= 1 while healing: the moments resharded to the
// generation's plan as reshard_optimizer does, the plan now (every rank
// alike) and the moves on the transfer's thread after the state, behind
// the update's fence. When some shard has no holder, the transfer is
// called off before it began and the checkpoint source's fallback loads
// the plan's checkpoint for every rank.
class healing_shards final : public shard_source {
 public:
  generation_end take(start_context& c, const shard_plan& plan) override {
    generation_run& g = c.g;
    flat_adamw& opt = c.state.optimizer();
    const bool holds_current = c.held_before == c.state.step();
    const bool masters = masters_sharded(c.rs.settings.train);
    auto p = plan_reshard(*g.pg, opt, plan, holds_current, g.timeout, g.abandon_now, moves_tag_base, masters);
    if (!p) {
      g.healing.reset();  // a receiving rank is reset: it holds nothing current
      return g.failed(p.message(), c.state.step());
    }
    if (!p->totals.complete) {
      g.healing.reset();
      g.transfer_bytes = 0;
      return checkpoint_source::fallback(c, plan, p->totals.missing);
    }
    c.rs.shards = plan;
    g.reshard_bytes = p->totals.bytes_in + p->totals.bytes_out;
    if (p->totals.moments_in > 0) g.optimizer = ev::optimizer_source::replica;
    // Sharded masters: every rank's bf16 copies are the agreed step's (a
    // receiving rank's from the root, before its forward), while some held
    // windows' masters are still on their way: the step computes with the
    // copies as they are.
    if (masters) opt.keep_compute_once();
    g.healing->add_moves(std::move(p.value()), opt, g.pg);
    g.healing->start(c.agreed.max_step);
    return std::nullopt;
  }
};

}  // namespace

status forward_state_landed(heal_transfer& t, int64_t step, const std::function<bool()>& abandon) {
  if (t.sending() || step != t.step()) return {};
  return t.forward_landed(abandon);
}

// Only what every rank of the generation shares (the job's settings, the
// agreement), so that all take the same state source: a rank that read an
// older checkpoint than the step a peer holds (global rank 0 reading the
// plan's) heals as a fresh rank does. A decision on this rank's own source
// sent it to another source than its peers, each waiting in a collective
// the other never joined, generation after generation.
bool heals(const start_context& c) {
  const job_settings& s = c.rs.settings;
  // ZeRO: every rank holds every parameter whole (in float32, or as bf16
  // copies with its shards' masters), none of them a mix of two steps.
  const bool zero_fits = s.train.zero == 0 || ((s.train.zero == 1 || s.train.zero == 2) && !c.any_params_mixed);
  return c.g.pg && !c.agreed.everyone_holds_it() && s.cluster.heal_while_training && zero_fits && s.modes.sync == sync_mode::every_step &&
         !c.agreed_from_disk && c.agreed.max_step < s.train.max_steps;
}

bool windows_from_reshard(const job_settings& s) { return s.train.zero >= 1 && s.modes.sync == sync_mode::every_step; }

std::unique_ptr<state_source> make_healing_state() { return std::make_unique<healing_state>(); }
std::unique_ptr<shard_source> make_healing_shards() { return std::make_unique<healing_shards>(); }
bool receives_while_training(const heal_transfer& t) { return !t.sending(); }
void after_landing(heal_transfer& t, std::function<void()> f) { t.after_landing(std::move(f)); }

}  // namespace dtactor
