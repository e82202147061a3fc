// Recovery figures of the fault handling, measured on real processes:
// ViT/Fashion-MNIST (the default config), 2 nodes x 1 rank, default heartbeat
// settings, every step journaled. For each kind of fault, N trials (default
// 5); prints one JSON object with the median and max of each figure.
//
//   bench_chaos [--trials N] [--kinds kill9,sigstop,sigterm,replace,coordinator] [--soak SECONDS [--soak-steps N] [--soak-only faults|clean]] [--set key=value ...]
//
// --set adds a config key to every job (e.g. train.zero=2). For bench/*.json
// (the benchmark page), pipe the JSON through `bench/bench_meta.py stamp
// FILE --kind chaos --command "..."`, which adds the command, machine and date.
//
// Times come from the coordinator's journal (`t`, unix seconds, written when
// every rank has reported a step) against the wall clock at the fault, so
// they include the report path: conservative.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <set>

#include "cluster_harness.hpp"
#include "storage/fs.hpp"

using namespace dtactor;
using namespace dtactor::testing;

namespace {

double unix_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

std::vector<std::string> g_sets;  // --set

std::vector<std::string> job(int64_t max_steps, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> all = extra;
  all.insert(all.end(), g_sets.begin(), g_sets.end());
  return set_flags({"train.log_every_steps=1", "eval.every_steps=0", "eval.max_samples=1000", "checkpoint.every_steps=200",
                    "train.max_steps=" + std::to_string(max_steps)},
                   all);
}

struct stats {
  std::vector<double> v;
  json to_json() const {
    if (v.empty()) return nullptr;
    auto s = v;
    std::sort(s.begin(), s.end());
    const double med = s.size() % 2 ? s[s.size() / 2] : (s[s.size() / 2 - 1] + s[s.size() / 2]) / 2;
    return {{"median", med}, {"max", s.back()}, {"n", s.size()}};
  }
};

std::string fresh_dir(const std::string& base, const std::string& name) {
  const std::string d = base + "/" + name;
  std::error_code ec;
  std::filesystem::remove_all(d, ec);
  std::filesystem::create_directories(d, ec);
  return d;
}

// First journaled step after unix time `t0` (optionally at world size `world`).
std::optional<json> first_step_after(const std::vector<json>& j, double t0, int world = 0) {
  for (const auto& e : journal_events<ev::step_completed>(j))
    if (e.at("t").get<double>() >= t0 && (world == 0 || e.at("world_size") == world)) return e;
  return std::nullopt;
}

// A recovery's phases: from the loss to the plan (node_lost to
// generation_started, the coordinator's clock), and recovery_done's drain
// (the survivors abandoning the step in flight), group, state and
// first-step seconds.
struct phase_stats {
  stats plan, drain, group, state, first;
  json to_json() const {
    return {{"plan", plan.to_json()}, {"drain", drain.to_json()}, {"group", group.to_json()}, {"state", state.to_json()}, {"first_step", first.to_json()}};
  }
};

// The phases of the first recovery after `t0`.
void recovery_phases(const std::vector<json>& j, double t0, phase_stats& p) {
  double lost_at = -1;
  for (const auto& l : journal_events<ev::node_lost>(j))
    if (l.at("t").get<double>() >= t0 && lost_at < 0) lost_at = l.at("t").get<double>();
  for (const auto& g : journal_events<ev::generation_started>(j))
    if (lost_at >= 0 && g.at("t").get<double>() >= lost_at) {
      p.plan.v.push_back(g.at("t").get<double>() - lost_at);
      break;
    }
  for (const auto& r : journal_events<ev::recovery_done>(j)) {
    if (r.at("t").get<double>() < t0 || !r.contains("group_s")) continue;
    if (r.contains("drain_s")) p.drain.v.push_back(r.at("drain_s").get<double>());
    p.group.v.push_back(r.at("group_s").get<double>());
    p.state.v.push_back(r.at("state_s").get<double>());
    p.first.v.push_back(r.at("first_step_s").get<double>());
    break;
  }
}

// Median gap between consecutive journaled steps (the steady step time).
double median_step_gap(const std::vector<json>& j, double before) {
  std::vector<double> gaps;
  double prev = -1;
  for (const auto& e : journal_events<ev::step_completed>(j)) {
    const double t = e.at("t").get<double>();
    if (t > before) break;
    if (prev > 0) gaps.push_back(t - prev);
    prev = t;
  }
  if (gaps.empty()) return 0;
  std::sort(gaps.begin(), gaps.end());
  return gaps[gaps.size() / 2];
}

double lost_steps(const std::vector<json>& j) {
  double lost = 0;
  for (const auto& r : journal_events<ev::recovery_done>(j)) lost += r.value("lost_steps", 0.0);
  return lost;
}

bool wait_steps(cluster& cl, int64_t steps, int world) { return cl.wait_step(steps, world, 120); }

}  // namespace

int main(int argc, char** argv) {
  int trials = 5;
  std::set<std::string> kinds = {"kill9", "sigstop", "sigterm", "replace", "coordinator"};
  int soak_s = 0;
  int64_t soak_steps = 12000;
  std::string soak_only;  // --soak-only faults|clean: one half of the soak
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--trials" && i + 1 < argc) trials = std::atoi(argv[++i]);
    else if (a == "--kinds" && i + 1 < argc) {
      kinds.clear();
      std::stringstream ss(argv[++i]);
      std::string k;
      while (std::getline(ss, k, ',')) kinds.insert(k);
    } else if (a == "--soak" && i + 1 < argc) soak_s = std::atoi(argv[++i]);
    else if (a == "--soak-steps" && i + 1 < argc) soak_steps = std::atoll(argv[++i]);
    else if (a == "--soak-only" && i + 1 < argc && (std::string(argv[i + 1]) == "faults" || std::string(argv[i + 1]) == "clean")) soak_only = argv[++i];
    else if (a == "--set" && i + 1 < argc) g_sets.push_back(argv[++i]);
    else {
      std::fprintf(stderr, "usage: bench_chaos [--trials N] [--kinds kill9,sigstop,sigterm,replace,coordinator] [--soak SECONDS [--soak-steps N] [--soak-only faults|clean]] [--set key=value ...]\n");
      return 2;
    }
  }
  const std::string base = (std::filesystem::temp_directory_path() / ("dtactor-chaos-" + std::to_string(::getpid()))).string();
  json out = {{"model", "vit (default config)"}, {"nodes", 2}, {"ranks_per_node", 1}, {"trials", trials}};

  if (kinds.count("kill9") || kinds.count("sigstop")) {
    for (const std::string kind : {"kill9", "sigstop"}) {
      if (!kinds.count(kind)) continue;
      stats to_step, detect, lost;
      phase_stats phases;
      for (int t = 0; t < trials; ++t) {
        cluster cl(fresh_dir(base, kind + std::to_string(t)), job(100000));
        cl.start({"a", "b"});
        if (!wait_steps(cl, 20, 2)) {
          std::fprintf(stderr, "%s trial %d: no training\n%s", kind.c_str(), t, cl.logs().c_str());
          continue;
        }
        const double t0 = unix_now();
        cl.signal_node("b", kind == "kill9" ? SIGKILL : SIGSTOP);
        cl.wait_for([&](const std::vector<json>& j) { return first_step_after(j, t0, 1).has_value(); }, 60);
        auto j = cl.journal();
        if (auto s = first_step_after(j, t0, 1)) to_step.v.push_back(s->at("t").get<double>() - t0);
        for (const auto& l : journal_events<ev::node_lost>(j)) detect.v.push_back(l.at("t").get<double>() - t0);
        recovery_phases(j, t0, phases);
        lost.v.push_back(lost_steps(j));
        std::fprintf(stderr, "%s trial %d: first step at world 1 after %.3f s\n", kind.c_str(), t, to_step.v.empty() ? -1 : to_step.v.back());
      }
      out[kind] = {{"first_step_at_new_world_s", to_step.to_json()},
                   {"detected_s", detect.to_json()},
                   {"lost_steps", lost.to_json()},
                   // The critical path after detection: the plan, then the
                   // survivors leaving the step in flight, the group and the
                   // agreement and state (the slowest rank's), then the
                   // first step (recovery_done's phases).
                   {"phases_s", phases.to_json()}};
    }
  }

  if (kinds.count("sigterm")) {
    stats pause, excess, step_time, lost;
    for (int t = 0; t < trials; ++t) {
      cluster cl(fresh_dir(base, "sigterm" + std::to_string(t)), job(100000));
      cl.start({"a", "b"});
      if (!wait_steps(cl, 20, 2)) continue;
      const double t0 = unix_now();
      cl.nodes.at("b").signal(SIGTERM);
      cl.wait_for([&](const std::vector<json>& j) { return first_step_after(j, t0, 1).has_value(); }, 60);
      auto j = cl.journal();
      auto first = first_step_after(j, t0, 1);
      if (!first) continue;
      // The survivor's pause: from the last step at world 2 to the first at world 1.
      double last2 = 0;
      for (const auto& e : journal_events<ev::step_completed>(j))
        if (e.at("world_size") == 2) last2 = e.at("t").get<double>();
      const double st = median_step_gap(j, t0);
      pause.v.push_back(first->at("t").get<double>() - last2);
      excess.v.push_back(first->at("t").get<double>() - last2 - st);
      step_time.v.push_back(st);
      lost.v.push_back(lost_steps(j));
    }
    out["sigterm"] = {{"survivor_pause_s", pause.to_json()},
                      {"pause_beyond_one_step_s", excess.to_json()},
                      {"step_time_s", step_time.to_json()},
                      {"lost_steps", lost.to_json()}};
  }

  if (kinds.count("replace")) {
    stats contributing, paused, lost;
    for (int t = 0; t < trials; ++t) {
      // A real replacement: b is killed, the job trains on at world 1, and a
      // cold node c (no process started before it) takes b's place.
      cluster cl(fresh_dir(base, "replace" + std::to_string(t)), job(100000));
      cl.start({"a", "b"});
      if (!wait_steps(cl, 20, 2)) continue;
      const double killed = unix_now();
      cl.signal_node("b", SIGKILL);
      if (!cl.wait_for([&](const std::vector<json>& j) { return first_step_after(j, killed, 1).has_value(); }, 60)) continue;
      cl.start_node("c");
      cl.wait_for([&](const std::vector<json>& j) {
        auto s = journal_events<ev::step_completed>(j);
        return !s.empty() && s.back().at("world_size") == 2 && s.back().at("t").get<double>() > killed;
      }, 60);
      auto j = cl.journal();
      double reg = 0;
      for (const auto& e : journal_events<ev::node_joined>(j))
        if (e.at("node") == "c") reg = e.at("t").get<double>();
      auto first = first_step_after(j, reg, 2);
      if (!first || reg == 0) continue;
      double last1 = 0;
      for (const auto& e : journal_events<ev::step_completed>(j))
        if (e.at("world_size") == 1) last1 = e.at("t").get<double>();
      contributing.v.push_back(first->at("t").get<double>() - reg);
      paused.v.push_back(first->at("t").get<double>() - last1 - median_step_gap(j, reg));
      lost.v.push_back(lost_steps(j));
    }
    out["replace"] = {{"contributing_after_register_s", contributing.to_json()},
                      {"others_paused_beyond_one_step_s", paused.to_json()},
                      {"lost_steps", lost.to_json()}};
  }

  if (kinds.count("coordinator")) {
    stats during, lost;
    for (int t = 0; t < trials; ++t) {
      const int node_metrics = pick_free_tcp_port().value();
      cluster cl(fresh_dir(base, "coord" + std::to_string(t)), job(100000));
      cl.start_coordinator();
      cl.start_node("a", {"--metrics-port", std::to_string(node_metrics)});
      cl.start_node("b");
      if (!wait_steps(cl, 20, 2)) continue;
      cl.coord->signal(SIGKILL);
      cl.coord->wait(10000);
      const double before = node_step(node_metrics);
      cl.nodes.at("a").wait(3000);  // the coordinator stays down 3 s
      during.v.push_back(node_step(node_metrics) - before);
      const double t1 = unix_now();
      cl.start_coordinator();
      cl.wait_for([&](const std::vector<json>& j) { return first_step_after(j, t1).has_value(); }, 60);
      lost.v.push_back(lost_steps(cl.journal()));
    }
    out["coordinator"] = {{"steps_completed_while_down_3s", during.to_json()}, {"lost_steps", lost.to_json()}};
  }

  if (soak_s > 0) {
    // Random faults (kill -9, SIGSTOP, SIGTERM of a node, kill -9 of a rank)
    // every 20-40 s for soak_s seconds on a job of soak_steps steps; a node
    // that went away is started again (a new incarnation). Then the same job
    // without faults, for the accuracy comparison.
    std::mt19937 rng(7);
    auto run_job = [&](const std::string& name, bool faults_on, json& rec) {
      cluster cl(fresh_dir(base, name), job(soak_steps, {"cluster.min_nodes=1", "eval.max_samples=0"}));
      cl.start({"a", "b"});
      const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(soak_s);
      int faults = 0;
      std::map<std::string, int> by_kind;
      while (faults_on && std::chrono::steady_clock::now() < end && cl.coord->running()) {
        if (cl.coord->wait(std::uniform_int_distribution<int>(20000, 40000)(rng))) break;
        const std::string victim = std::uniform_int_distribution<int>(0, 1)(rng) ? "a" : "b";
        const int k = std::uniform_int_distribution<int>(0, 3)(rng);
        const char* names[] = {"kill9", "sigstop", "sigterm", "rank_kill"};
        if (k == 0) cl.signal_node(victim, SIGKILL);
        else if (k == 1) cl.signal_node(victim, SIGSTOP);
        else if (k == 2) cl.nodes.at(victim).signal(SIGTERM);
        else {
          auto kids = descendants(cl.nodes.at(victim).pid());
          if (!kids.empty()) ::kill(kids[0], SIGKILL);
        }
        ++faults;
        ++by_kind[names[k]];
        std::fprintf(stderr, "soak: %s of %s\n", names[k], victim.c_str());
        if (k <= 2) {
          cl.coord->wait(3000);
          if (k == 1) cl.signal_node(victim, SIGKILL);
          cl.nodes.at(victim).wait(15000);
          cl.start_node(victim);
        }
      }
      cl.coord->wait(1800000);
      auto j = cl.journal();
      auto fin = journal_events<ev::job_finished>(j);
      rec = {{"faults", faults},
             {"by_kind", by_kind},
             {"recoveries", journal_events<ev::recovery_done>(j).size()},
             {"lost_steps", lost_steps(j)},
             {"finished", !fin.empty()},
             {"accuracy", fin.empty() ? json(nullptr) : fin[0].value("accuracy", json(nullptr))},
             {"wall_s", j.empty() ? 0.0 : j.back().at("t").get<double>() - j.front().at("t").get<double>()}};
    };
    json faulty, clean;
    if (soak_only != "clean") run_job("soak", true, faulty);
    if (soak_only != "faults") run_job("soak-clean", false, clean);
    out["soak"] = {{"seconds", soak_s}, {"steps", soak_steps}, {"with_faults", faulty}, {"fault_free", clean}};
    if (!g_sets.empty()) out["set"] = g_sets;
  }
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
