#include "app/chaos.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>

namespace dtactor {

namespace {

template <class... F>
struct overloaded : F... {
  using F::operator()...;
};
template <class... F>
overloaded(F...) -> overloaded<F...>;

std::string seconds(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f s", s);
  return b;
}

// Median and maximum of the values >= 0.
std::pair<double, double> median_max(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return x < 0; }), v.end());
  if (v.empty()) return {-1, -1};
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return {n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2, v.back()};
}

}  // namespace

chaos_monkey::chaos_monkey(chaos_options o, hooks h)
    : opts_(o), h_(std::move(h)), rng_(o.seed ? o.seed : static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count())) {}

void chaos_monkey::on(const ev::journal_event& e, double t) {
  std::visit(overloaded{
                 [&](const ev::step_completed& s) {
                   if (phase_ == phase::warming) {
                     phase_ = phase::armed;
                     due_ = t + opts_.every_s;
                   }
                   if (phase_ == phase::awaiting_join && t >= started_t_ && s.world_size > world_) {
                     current_.joined_s = t - started_t_;
                     h_.say(current_.replacement + " joined: training at world size " + std::to_string(s.world_size) + ", " +
                            seconds(current_.joined_s) + " after its process started");
                     done_.push_back(current_);
                     phase_ = phase::armed;
                     due_ = t + opts_.every_s;
                   }
                   world_ = phase_ == phase::awaiting_join ? world_ : s.world_size;
                 },
                 [&](const ev::node_lost& l) {
                   if (phase_ == phase::awaiting_recovery && l.node == current_.node && current_.detected_s < 0) current_.detected_s = t - kill_t_;
                 },
                 [&](const ev::recovery_done& r) { recovered(r, t); },
                 [&](const ev::job_finished&) { phase_ = phase::ended; },
                 [&](const ev::job_stopped&) { phase_ = phase::ended; },
                 [&](const ev::job_failed&) { phase_ = phase::ended; },
                 [](const auto&) {},
             },
             e);
}

void chaos_monkey::recovered(const ev::recovery_done& r, double t) {
  // The generation that left the killed node out: after its loss was declared
  // (a generation of the same members, after a failed collective, comes first
  // sometimes).
  if (phase_ != phase::awaiting_recovery || current_.detected_s < 0) return;
  current_.first_step_s = t - kill_t_;
  current_.world = r.world_size;
  current_.lost_steps = r.lost_steps;
  world_ = r.world_size;
  report(current_);
  if (auto id = h_.start()) {
    current_.replacement = *id;
    started_t_ = t;
    phase_ = phase::awaiting_join;
    h_.say("started " + *id + " as a replacement");
  } else {
    done_.push_back(current_);
    phase_ = phase::armed;
    due_ = t + opts_.every_s;
  }
}

void chaos_monkey::report(const chaos_recovery& r) {
  h_.say("recovered from the loss of " + r.node + ": detected in " + seconds(r.detected_s) + ", training at world size " + std::to_string(r.world) + " " +
         seconds(r.first_step_s) + " after the kill, " + std::to_string(r.lost_steps) + " step(s) lost");
}

void chaos_monkey::tick(double now) {
  if ((phase_ == phase::awaiting_recovery || phase_ == phase::awaiting_join) && now - std::max(kill_t_, started_t_) > opts_.give_up_s) {
    h_.say(phase_ == phase::awaiting_recovery ? "no recovery from the loss of " + current_.node + " seen in the journal; going on"
                                              : current_.replacement + " did not join in time; going on");
    done_.push_back(current_);
    phase_ = phase::armed;
    due_ = now + opts_.every_s;
  }
  if (phase_ == phase::armed && now >= due_) kill_one(now);
}

void chaos_monkey::kill_one(double now) {
  auto alive = h_.alive();
  if (alive.size() < 2) {  // never the last one: there would be nobody to recover
    due_ = now + opts_.every_s;
    return;
  }
  std::uniform_int_distribution<std::size_t> pick(0, alive.size() - 1);
  current_ = chaos_recovery{};
  current_.node = alive[pick(rng_)];
  kill_t_ = now;
  started_t_ = 0;
  h_.kill(current_.node);
  h_.say("killed " + current_.node + " (SIGKILL to the node and its ranks)");
  phase_ = phase::awaiting_recovery;
}

std::string chaos_monkey::summary() const {
  if (done_.empty()) return "";
  std::vector<double> detected, first, joined;
  int64_t lost = 0;
  for (const auto& r : done_) {
    detected.push_back(r.detected_s);
    first.push_back(r.first_step_s);
    joined.push_back(r.joined_s);
    lost += r.lost_steps;
  }
  const auto [dm, dx] = median_max(detected);
  const auto [fm, fx] = median_max(first);
  const auto [jm, jx] = median_max(joined);
  std::string s = std::to_string(done_.size()) + " node(s) killed; ";
  if (dm >= 0) s += "detected in " + seconds(dm) + " (median; max " + seconds(dx) + "), ";
  if (fm >= 0) s += "training at the new world size " + seconds(fm) + " after the kill (median; max " + seconds(fx) + "), ";
  s += std::to_string(lost) + " step(s) lost in all";
  if (jm >= 0) s += "; replacements training " + seconds(jm) + " after their start (median; max " + seconds(jx) + ")";
  return s;
}

std::vector<ev::journal_line> journal_tail::read_new() {
  std::vector<ev::journal_line> out;
  std::ifstream f(path_, std::ios::binary);
  if (!f) return out;
  f.seekg(static_cast<std::streamoff>(offset_));
  std::string chunk((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  offset_ += chunk.size();
  partial_ += chunk;
  std::size_t start = 0, nl;
  while ((nl = partial_.find('\n', start)) != std::string::npos) {
    auto line = ev::read_journal_line(std::string_view(partial_).substr(start, nl - start));
    if (line && line.value()) out.push_back(std::move(*line.value()));
    start = nl + 1;
  }
  partial_.erase(0, start);
  return out;
}

}  // namespace dtactor
