// The coordinator process: membership/rendezvous and job actors (actors/),
// a registry actor that keeps the journal, the checkpoints and the job's
// metrics, the ZeroMQ bridge to the nodes and the c10d store ranks meet at.
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <caf/all.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <set>

#include "actors/coordinator_actors.hpp"
#include "actors/messages.hpp"
#include "app/caf_setup.hpp"
#include "app/cluster.hpp"
#include "app/cluster_util.hpp"
#include "model/task.hpp"
#include "model/trainer.hpp"
#include "monitoring/journal.hpp"
#include "monitoring/metrics.hpp"
#include "monitoring/resources.hpp"
#include "monitoring/run_observer.hpp"
#include "monitoring/service_discovery.hpp"
#include "runtime/checkpoint_store.hpp"
#include "runtime/fs.hpp"
#include "runtime/wire.hpp"
#include "runtime/zmq_bridge.hpp"

namespace dtactor {

namespace {

int fail(const std::string& msg, int code = 1) {
  std::fprintf(stderr, "dtactor: %s\n", msg.c_str());
  return code;
}

// What the coordinator's registry needs, shared with the process's main thread.
struct coordinator_shared {
  journal jn;
  metrics* m = nullptr;
  std::unique_ptr<run_observer> obs;  // TensorBoard events and the console progress line
  resource_book usage;                // ranks' CPU and memory, for `resources` events
  std::optional<checkpoint_store> store;
  config cfg;
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  int exit_code = 0;
  int64_t max_steps = 0;
  // The newest checkpoint saved (a serialized pb::checkpoint_data) and its
  // step: what a generation with no surviving state holder starts from.
  std::mutex ckpt_mu;
  std::string newest_checkpoint;
  int64_t newest_checkpoint_step = -1;
};

// Per-step aggregation of the ranks' reports.
struct step_row {
  int world = 0;
  int reports = 0;
  int steps = 1;  // steps the reports cover
  double loss_weighted = 0;
  int64_t samples = 0;
  double max_step_s = 0;
  double allreduce_s = 0, exposed_s = 0;
  double lr = 0;
};

// A generation after the first: what started it and how it went.
struct recovery {
  uint64_t generation = 0;
  std::string cause;
  bool drain = false;
  std::chrono::steady_clock::time_point planned{};
  int64_t steps_before = 0;  // highest step known completed when it was planned
  int64_t resumed_step = -1;
  int64_t rolled_back = 0;
  bool restored_logged = false;
  bool done = false;
};

struct registry_state {
  coordinator_shared* sh = nullptr;
  uint64_t generation = 0;
  int32_t world = 0;
  recovery rec;
  std::map<int64_t, step_row> steps;
  std::map<int32_t, std::string> finished;  // global rank -> params digest
  std::map<std::string, double> last_eval;
  int64_t last_step = 0;
  static inline const char* name = "dtactor.registry";
};

using registry_self = caf::stateful_actor<registry_state>*;

using gen_atom = caf::atom_constant<caf::atom("gen")>;

void finish_recovery(registry_self self, int64_t step, int32_t world);

void on_step(registry_self self, const pb::step_report& r) {
  auto& st = self->state;
  auto& row = st.steps[r.step()];
  row.world = r.world_size();
  row.steps = std::max(1, r.steps_covered());
  ++row.reports;
  row.loss_weighted += r.loss() * static_cast<double>(r.samples());
  row.samples += r.samples();
  row.max_step_s = std::max(row.max_step_s, r.step_s());
  row.allreduce_s = std::max(row.allreduce_s, r.allreduce_s());
  row.exposed_s = std::max(row.exposed_s, r.allreduce_exposed_s());
  row.lr = r.lr();
  if (r.peak_rss_bytes() > 0) st.sh->usage.note(r.global_rank(), r.node_id(), {r.cpu_s(), r.rss_bytes(), r.peak_rss_bytes(), r.process_age_s()});
  if (st.sh->m && r.data_wait_s() > 0) st.sh->m->data_wait().Observe(r.data_wait_s() * (1.0 / std::max(1, r.steps_covered())));
  if (row.reports < row.world) return;
  // Every rank has reported this step.
  auto* m = st.sh->m;
  const int64_t step = r.step();
  finish_recovery(self, step, row.world);
  st.last_step = std::max(st.last_step, step);
  const double loss = row.samples > 0 ? row.loss_weighted / static_cast<double>(row.samples) : 0.0;
  const double sps = row.max_step_s > 0 ? static_cast<double>(row.samples) / row.max_step_s : 0.0;
  const double per_step = 1.0 / row.steps;
  if (m) {
    m->step().Set(static_cast<double>(step));
    m->samples().Increment(static_cast<double>(row.samples));
    m->loss().Set(loss);
    m->learning_rate().Set(row.lr);
    m->samples_per_second().Set(sps);
    m->step_duration().Observe(row.max_step_s * per_step);
    m->allreduce_duration().Observe(row.allreduce_s * per_step);
  }
  st.sh->jn.write("step", {{"step", step},
                           {"world_size", row.world},
                           {"generation", st.generation},
                           {"loss", loss},
                           {"lr", row.lr},
                           {"samples_per_s", sps},
                           {"allreduce_s", row.allreduce_s * per_step},
                           {"allreduce_exposed_s", row.exposed_s * per_step}});
  st.sh->obs->on_step(step, loss, row.lr, sps, row.world);
  if (st.sh->usage.due(unix_time_now())) st.sh->jn.write("resources", st.sh->usage.to_json());
  st.steps.erase(st.steps.begin(), st.steps.upper_bound(step));
}

// Called with the first step every rank of a new generation completed.
void finish_recovery(registry_self self, int64_t step, int32_t world) {
  auto& st = self->state;
  auto& rec = st.rec;
  if (rec.done || rec.generation != st.generation) return;
  rec.done = true;
  if (rec.cause == "start" || rec.cause == "adopted" || rec.cause.empty()) return;
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - rec.planned).count();
  const int64_t resumed = rec.resumed_step >= 0 ? rec.resumed_step : step - 1;
  const int64_t lost = std::max<int64_t>(0, rec.steps_before - resumed);
  st.sh->jn.write("recovery_done", {{"generation", st.generation},
                                    {"world_size", world},
                                    {"cause", rec.cause},
                                    {"drain", rec.drain},
                                    {"resumed_step", resumed},
                                    {"rolled_back_steps", rec.rolled_back},
                                    {"lost_steps", lost},
                                    {"duration_s", dt}});
  if (auto* m = st.sh->m) {
    m->recoveries(rec.cause).Increment();
    m->recovery().Observe(dt);
    if (lost > 0) m->lost_steps().Increment(static_cast<double>(lost));
  }
  char line[160];
  std::snprintf(line, sizeof line, "recovered (%s): world %d from step %lld in %.2f s", rec.cause.c_str(), world, static_cast<long long>(resumed), dt);
  st.sh->obs->note_event(line);
}

void on_ready(registry_self self, const pb::rank_status& s) {
  auto& st = self->state;
  auto& rec = st.rec;
  if (rec.generation != st.generation) return;
  rec.resumed_step = std::max(rec.resumed_step, s.step());
  rec.rolled_back = std::max(rec.rolled_back, s.rolled_back_steps());
  const auto& src = s.state_source();
  if ((src == "peer" || src == "disk") && !rec.restored_logged) {
    rec.restored_logged = true;
    st.sh->jn.write("checkpoint_restored", {{"step", s.step()}, {"source", src}, {"generation", st.generation}, {"root", s.state_root()}});
  }
}

void on_checkpoint(registry_self self, uint64_t generation, const pb::checkpoint_data& d) {
  auto& st = self->state;
  pb::checkpoint_meta meta;
  if (!meta.ParseFromString(d.meta())) {
    st.sh->jn.write("checkpoint_failed", {{"step", d.step()}, {"reason", "meta does not parse"}});
    return;
  }
  meta.set_generation(generation);
  std::vector<std::pair<std::string, std::string>> sections;
  size_t bytes = 0;
  for (const auto& s : d.sections()) {
    sections.emplace_back(s.name(), s.data());
    bytes += s.data().size();
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto path = st.sh->store->save(std::move(meta), sections);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!path) {
    st.sh->obs->log("dtactor: checkpoint at step " + std::to_string(d.step()) + " not saved: " + path.message());
    st.sh->jn.write("checkpoint_failed", {{"step", d.step()}, {"reason", path.message()}});
    return;
  }
  if (st.sh->m) st.sh->m->checkpoint_saved(d.step(), static_cast<double>(bytes), dt);
  st.sh->obs->note_event("checkpoint " + std::to_string(d.step()));
  {
    // What a generation with no surviving state starts from (all nodes lost).
    pb::checkpoint_data plain;
    plain.set_step(d.step());
    *plain.mutable_sections() = d.sections();
    std::lock_guard<std::mutex> lock(st.sh->ckpt_mu);
    if (d.step() >= st.sh->newest_checkpoint_step) {
      plain.SerializeToString(&st.sh->newest_checkpoint);
      st.sh->newest_checkpoint_step = d.step();
    }
  }
  st.sh->jn.write("checkpoint_saved", {{"step", d.step()}, {"path", path.value()}, {"bytes", bytes}, {"generation", generation}, {"duration_s", dt}});
}

// Ends the job with an error that no new generation can fix (ranks that
// diverged).
void fail_job(registry_self self, const std::string& reason) {
  auto& st = self->state;
  {
    std::lock_guard<std::mutex> lock(st.sh->mu);
    if (st.sh->finished) return;
  }
  if (!st.sh->usage.empty()) st.sh->jn.write("resources", st.sh->usage.to_json());
  st.sh->jn.write("job_failed", {{"step", st.last_step}, {"generation", st.generation}, {"reason", reason}});
  std::fprintf(stderr, "dtactor: the job stops at step %lld: %s; start it again to resume from the newest checkpoint\n",
               static_cast<long long>(st.last_step), reason.c_str());
  {
    std::lock_guard<std::mutex> lock(st.sh->mu);
    st.sh->finished = true;
    st.sh->exit_code = 1;
  }
  st.sh->cv.notify_all();
}

void maybe_finish(registry_self self) {
  auto& st = self->state;
  if (st.world <= 0 || static_cast<int32_t>(st.finished.size()) < st.world) return;
  std::set<std::string> digests;
  for (const auto& [r, d] : st.finished) digests.insert(d);
  nlohmann::json ev = {{"step", st.last_step}, {"params_digest", *digests.begin()}, {"world_size", st.world}, {"generation", st.generation}};
  for (const auto& [k, v] : st.last_eval) ev[k] = v;
  int code = 0;
  if (digests.size() != 1) {
    ev["error"] = "ranks finished with different parameters";
    code = 1;
  }
  if (!st.sh->usage.empty()) st.sh->jn.write("resources", st.sh->usage.to_json());
  const bool stopped = st.last_step < st.sh->max_steps;
  st.sh->jn.write(stopped ? "job_stopped" : "job_finished", ev);
  st.sh->obs->finish();
  std::fprintf(stdout, "%s at step %lld:", stopped ? "stopped" : "finished", static_cast<long long>(st.last_step));
  for (const auto& [k, v] : st.last_eval) std::fprintf(stdout, " %s=%.4f", k.c_str(), v);
  std::fprintf(stdout, " params_digest=%s world_size=%d\n", digests.begin()->c_str(), st.world);
  std::fflush(stdout);
  {
    std::lock_guard<std::mutex> lock(st.sh->mu);
    st.sh->finished = true;
    st.sh->exit_code = code;
  }
  st.sh->cv.notify_all();
}

caf::behavior registry_actor(registry_self self, coordinator_shared* sh) {
  self->state.sh = sh;
  return {
      [=](gen_atom, uint64_t generation, int32_t world, const std::string& cause, bool drain) {
        auto& st = self->state;
        if (generation <= st.generation) return;
        st.rec = recovery{};
        st.rec.generation = generation;
        st.rec.cause = st.generation == 0 && cause != "restart" ? "start" : cause;
        st.rec.drain = drain;
        st.rec.planned = std::chrono::steady_clock::now();
        st.rec.steps_before = st.last_step;
        st.generation = generation;
        st.world = world;
        st.steps.clear();
        st.finished.clear();
        if (st.sh->m) {
          st.sh->m->generation().Set(static_cast<double>(generation));
          st.sh->m->world_size().Set(world);
        }
        st.sh->obs->on_generation(generation, world, st.last_step);
      },
      [=](inbound& in) {
        auto& st = self->state;
        const auto& env = in.env;
        // Fencing: reports from another generation than the current one are
        // dropped (a zombie can neither steer the job nor write state).
        if (env.generation() != st.generation) return;
        switch (env.body_case()) {
          case pb::envelope::kStepReport:
            on_step(self, env.step_report());
            break;
          case pb::envelope::kEvalReport: {
            const auto& e = env.eval_report();
            nlohmann::json ev = {{"step", e.step()}, {"duration_s", e.duration_s()}};
            st.last_eval.clear();
            for (const auto& [k, v] : e.metrics()) {
              ev[k] = v;
              st.last_eval[k] = v;
            }
            std::vector<std::string> ex(e.examples().begin(), e.examples().end());
            if (!ex.empty()) ev["examples"] = ex;
            st.sh->jn.write("eval", ev);
            st.sh->obs->on_eval(e.step(), st.last_eval);
            if (st.sh->m) {
              for (const auto& [k, v] : e.metrics()) st.sh->m->eval_metric(k).Set(v);
              st.sh->m->eval_step().Set(static_cast<double>(e.step()));
            }
            break;
          }
          case pb::envelope::kCheckpointData:
            on_checkpoint(self, env.generation(), env.checkpoint_data());
            break;
          case pb::envelope::kRankStatus: {
            const auto& s = env.rank_status();
            if (s.status() == pb::rank_status::STATE_FINISHED) {
              st.finished[s.global_rank()] = s.detail();
              st.last_step = std::max(st.last_step, s.step());
              maybe_finish(self);
            } else if (s.status() == pb::rank_status::STATE_READY) {
              on_ready(self, s);
            } else if (s.status() == pb::rank_status::STATE_FAILED || s.status() == pb::rank_status::STATE_EXITED) {
              {
                std::lock_guard<std::mutex> lock(st.sh->mu);
                if (st.sh->finished) break;  // ranks ending after the job did
              }
              // Recorded; the membership actor re-plans (a new generation
              // without the lost rank, or the same members re-formed).
              st.sh->jn.write(s.status() == pb::rank_status::STATE_FAILED ? "rank_failed" : "rank_exited",
                              {{"rank", s.global_rank()}, {"local_rank", s.local_rank()}, {"node", env.sender()}, {"detail", s.detail()},
                               {"exit_code", s.exit_code()}, {"step", s.step()}, {"generation", env.generation()}});
              if (s.detail().rfind("parameters differ", 0) == 0) fail_job(self, "rank " + std::to_string(s.global_rank()) + ": " + s.detail());
            }
            break;
          }
          case pb::envelope::kJobError:
            st.sh->jn.write("job_error", {{"node", env.sender()}, {"message", env.job_error().message()}});
            break;
          default:
            break;
        }
      },
  };
}

result<config> checked_setup(const cluster_cli& cli, int& code) {
  code = 2;
  auto loaded = config::load(cli.config_path, cli.overrides);
  if (!loaded) return loaded.err();
  const config& cfg = loaded.value();
  if (auto st = validate_training_config(cfg); !st) return st.err();
  if (auto why = validate(liveness_options_from(cfg)); !why.empty()) return make_error(why);
  if (auto why = validate(membership_options_from(cfg)); !why.empty()) return make_error(why);
  if (auto listen = parse_tcp_endpoint(cli.listen, "--listen"); !listen) return listen.err();
  code = 1;
  if (auto st = ensure_writable_dir(cli.run_dir); !st) return make_error("run directory: " + st.message());
  if (auto who = file_lock::holder(run_dir_lock_path(cli.run_dir)); !who.empty())
    return make_error(run_dir_busy_message(cli.run_dir, "held by " + who));
  return loaded;
}

}  // namespace

setup_check check_coordinator_setup(const cluster_cli& cli) {
  setup_check c;
  auto r = checked_setup(cli, c.code);
  if (r) c.code = 0;
  else c.message = r.message();
  return c;
}

int run_coordinator(const cluster_cli& cli) {
  int setup_code = 0;
  auto loaded = checked_setup(cli, setup_code);
  if (!loaded) return fail(loaded.message(), setup_code);
  auto sh = std::make_unique<coordinator_shared>();
  sh->cfg = std::move(loaded.value());
  const config& cfg = sh->cfg;
  sh->max_steps = cfg.get_int("train.max_steps");
  auto listen = parse_tcp_endpoint(cli.listen, "--listen");
  // One writer per run directory: a second coordinator (or `dtactor train`)
  // would interleave its journal and checkpoints with this one's. A crashed
  // holder's lock is free again.
  auto run_lock = file_lock::try_acquire(run_dir_lock_path(cli.run_dir), "dtactor coordinator on " + cli.listen);
  if (!run_lock) return fail(run_dir_busy_message(cli.run_dir, run_lock.message()));
  if (auto st = sh->jn.open(cli.run_dir + "/journal.jsonl"); !st) return fail(st.message());
  const std::string config_text = cfg.to_toml();
  if (auto st = write_file_atomic(cli.run_dir + "/config.toml", {config_text}); !st) return fail(st.message());
  sh->obs = std::make_unique<run_observer>(
      run_observer::options{cli.run_dir, cfg.get_int("train.max_steps"), progress::stderr_is_terminal(), cli.run_dir + "/train.log"});

  checkpoint_policy policy;
  policy.keep_last = static_cast<int>(cfg.get_int("checkpoint.keep_last"));
  policy.keep_best = cfg.get_bool("checkpoint.keep_best");
  policy.best_metric = cfg.get_string("checkpoint.best_metric").empty() ? main_metric_for(cfg.get_string("model.name"))
                                                                         : cfg.get_string("checkpoint.best_metric");
  policy.higher_is_better = higher_is_better(policy.best_metric);
  const std::string ckpt_dir = cfg.get_string("checkpoint.dir").empty() ? cli.run_dir + "/checkpoints" : cfg.get_string("checkpoint.dir");
  auto store = checkpoint_store::open(ckpt_dir, policy);
  if (!store) return fail(store.message());
  sh->store.emplace(std::move(store.value()));

  // Resume from disk: the newest valid checkpoint goes to global rank 0 of
  // generation 1, which broadcasts it.
  std::string resume_blob;
  int64_t resume_step = -1;
  auto newest = cli.no_resume ? result<std::optional<loaded_checkpoint>>(std::optional<loaded_checkpoint>{})
                               : sh->store->load_newest_valid([&](const std::string& path, const std::string& why) {
                                   std::fprintf(stderr, "dtactor: skipping checkpoint %s: %s\n", path.c_str(), why.c_str());
                                   sh->jn.write("checkpoint_skipped", {{"path", path}, {"reason", why}});
                                 });
  if (!newest) return fail(newest.message());
  if (newest.value()) {
    const auto& ck = *newest.value();
    if (auto st = check_checkpoint_compatible(ck.meta, cfg, ck.path); !st) return fail(st.message(), 2);
    pb::checkpoint_data d;
    d.set_step(ck.meta.step());
    for (const auto& [name, data] : ck.sections) {
      auto* s = d.add_sections();
      s->set_name(name);
      s->set_data(data);
    }
    d.SerializeToString(&resume_blob);
    resume_step = ck.meta.step();
    // checkpoint_restored is journaled when a rank reports it loaded it.
    sh->jn.write("checkpoint_found", {{"step", resume_step}, {"path", ck.path}});
    if (resume_step >= sh->max_steps)
      std::fprintf(stderr, "coordinator: %s already holds a checkpoint at step %lld, at train.max_steps: nothing left to train (--no-resume starts over)\n",
                   cli.run_dir.c_str(), static_cast<long long>(resume_step));
    else
      std::fprintf(stderr, "coordinator: resuming from step %lld (%s; --no-resume starts over)\n", static_cast<long long>(resume_step),
                   ck.path.c_str());
  }

  const std::string job_id = job_id_for(cli.run_dir);
  metrics m(job_id);
  sh->m = &m;
  m.checkpoint_last_timestamp().SetToCurrentTime();  // "checkpoint too old" counts from the start
  m.max_steps().Set(static_cast<double>(cfg.get_int("train.max_steps")));
  // Prometheus finds the nodes through GET /sd (http_sd_configs); see monitoring/service_discovery.hpp.
  auto sd = std::make_shared<sd_targets>(job_id);
  m.add_route("/sd", "application/json", [sd] { return sd->json(); });
  if (cli.metrics_port > 0)
    if (auto st = m.serve(cli.metrics_port, cli.metrics_addr); !st) return fail(st.message());
  sd->set_coordinator(!cli.advertise_addr.empty() ? cli.advertise_addr : listen->host == "0.0.0.0" || listen->host == "*" ? host_name() : listen->host,
                      m.port());

  // The c10d store ranks build their communicators through.
  auto store_port = pick_free_tcp_port();
  if (!store_port) return fail(store_port.message());
  c10::intrusive_ptr<c10d::TCPStore> tcp_store;
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(store_port.value());
    so.isServer = true;
    so.waitWorkers = false;
    // The store serves rendezvous: ranks of a generation may arrive seconds apart.
    so.timeout = std::max<std::chrono::milliseconds>(std::chrono::milliseconds(cfg.get_int("cluster.collective_timeout_ms")),
                                                     std::chrono::seconds(60));
    tcp_store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  } catch (const std::exception& e) {
    return fail(std::string("cannot start the c10d store: ") + e.what());
  }

  caf::actor_system_config sys_cfg;
  configure_caf(sys_cfg, 2);
  caf::actor_system sys{sys_cfg};

  const uint64_t incarnation = wire::new_incarnation();
  envelope_header header;
  header.job_id = job_id;
  header.sender = "coordinator";
  header.incarnation = incarnation;

  // Actors send through this pointer; it is set once the bridge exists and
  // cleared before the bridge stops (actors may still be running then).
  std::unique_ptr<zmq_bridge> bridge;
  std::atomic<zmq_bridge*> bridge_ptr{nullptr};
  auto registry = sys.spawn<caf::detached>(registry_actor, sh.get());
  // Outbound tap: the journal's membership events are read off what the
  // membership actor sends (accepted acks, new plans).
  std::mutex tap_mu;
  std::map<std::string, std::string> peer_node;  // routing id -> node id
  std::atomic<uint64_t> last_plan_gen{0};
  std::set<std::string> joined_peers;  // peers already admitted as scrape targets
  outbound out = [&](const std::string& link, const std::string& peer, pb::envelope env) {
    if (env.has_register_ack() && env.register_ack().accepted()) {
      // node_joined is journaled from the membership events; here the
      // node becomes a scrape target.
      std::lock_guard<std::mutex> lock(tap_mu);
      if (joined_peers.insert(peer).second) sd->admit(peer);
    } else if (env.has_generation_plan()) {
      std::lock_guard<std::mutex> lock(tap_mu);
      const auto& p = env.generation_plan();
      if (p.generation() > last_plan_gen) {
        last_plan_gen = p.generation();
        std::set<std::string> nodes;
        for (const auto& r : p.ranks()) nodes.insert(r.node_id());
        sh->jn.write("generation_started", {{"generation", p.generation()},
                                            {"world_size", p.world_size()},
                                            {"cause", p.cause()},
                                            {"drain", p.drain()},
                                            {"start_step", p.start_step()},
                                            {"state_root", p.state_root()},
                                            {"nodes", std::vector<std::string>(nodes.begin(), nodes.end())}});
        m.nodes_alive().Set(static_cast<double>(nodes.size()));
        caf::anon_send(registry, gen_atom::value, p.generation(), p.world_size(), p.cause(), p.drain());
        sh->obs->log("generation " + std::to_string(p.generation()) + ": world size " + std::to_string(p.world_size()) + ", from step " +
                     std::to_string(p.start_step()));
      }
    }
    if (auto* b = bridge_ptr.load()) (void)b->send(link, peer, env);
  };

  coordinator_options copts = coordinator_options_from(cfg);
  copts.header = header;
  copts.store_host = cli.advertise_addr.empty() ? (listen->host == "0.0.0.0" || listen->host == "*" ? "" : listen->host) : cli.advertise_addr;
  copts.store_port = store_port.value();
  copts.config_toml = config_text;
  {
    std::lock_guard<std::mutex> lock(sh->ckpt_mu);
    sh->newest_checkpoint = resume_blob;
    sh->newest_checkpoint_step = resume_step;
  }
  copts.newest_checkpoint = [shp = sh.get()]() -> std::pair<int64_t, std::string> {
    std::lock_guard<std::mutex> lock(shp->ckpt_mu);
    return {shp->newest_checkpoint_step, shp->newest_checkpoint};
  };
  // Membership events go to the journal and the metrics (on the membership
  // actor's thread; the journal is thread-safe).
  copts.on_event = [&, shp = sh.get()](const cluster_event& e) {
    if (e.kind == "node_joined") {
      shp->jn.write("node_joined", {{"node", e.node}});
    } else if (e.kind == "node_lost") {
      shp->jn.write("node_lost", {{"node", e.node}, {"cause", e.cause}, {"detected_after_s", e.detected_after_s}});
      shp->obs->note_event("node " + e.node + " lost");
      m.failure_detection().Observe(e.detected_after_s);
    } else if (e.kind == "node_left") {
      shp->jn.write("node_left", {{"node", e.node}, {"reason", e.detail}});
      shp->obs->note_event("node " + e.node + " left");
    } else if (e.kind == "node_quarantined") {
      shp->jn.write("node_quarantined", {{"node", e.node}, {"reason", e.detail}});
    } else if (e.kind == "job_waiting") {
      shp->jn.write("job_waiting", {{"generation", e.generation}, {"reason", e.detail}});
      shp->obs->note_event("waiting for nodes (below cluster.floor_nodes)");
    } else if (e.kind == "generation_adopted") {
      shp->jn.write("generation_adopted", {{"generation", e.generation}, {"world_size", e.world_size}});
      uint64_t prev = last_plan_gen.load();
      while (prev < e.generation && !last_plan_gen.compare_exchange_weak(prev, e.generation)) {
      }
      m.generation().Set(static_cast<double>(e.generation));
      m.world_size().Set(e.world_size);
      caf::anon_send(registry, gen_atom::value, e.generation, e.world_size, std::string("adopted"), true);
      shp->obs->log("coordinator: adopted the running generation " + std::to_string(e.generation) + " (world size " + std::to_string(e.world_size) +
                    ")");
    }
  };
  // Through the progress line's owner: a log line never runs into the live line.
  copts.log = [shp = sh.get()](const std::string& line) { shp->obs->log("coordinator: " + line); };
  job_options jopts = job_options_from(cfg);
  jopts.header = header;
  jopts.initial_step = std::max<int64_t>(0, resume_step);
  jopts.log = copts.log;
  auto job = sys.spawn(job_actor, jopts, out);
  auto members = sys.spawn(membership_actor, copts, out, job);

  zmq_bridge_options bo;
  bo.job_id = job_id;
  bridge = std::make_unique<zmq_bridge>(
      bo,
      [&](const std::string& link, const std::string& peer, pb::envelope env) {
        if (env.has_register_node()) {
          std::lock_guard<std::mutex> lock(tap_mu);
          peer_node[peer] = env.register_node().node_id();
          sd->note_registration(peer, env.register_node().node_id(), env.register_node().advertise_addr(), env.register_node().metrics_port());
        }
        const bool report = env.has_step_report() || env.has_eval_report() || env.has_checkpoint_data() || env.has_rank_status() ||
                            env.has_job_error();
        if (report) caf::anon_send(registry, inbound{link, peer, env});
        caf::anon_send(members, inbound{link, peer, std::move(env)});
      },
      [&](const std::string&, const std::string&, wire::drop_kind k) { m.wire_dropped_frames(wire::to_string(k)).Increment(); });
  bridge_ptr.store(bridge.get());
  auto bound = bridge->add_router(links::nodes, cli.listen);
  if (!bound) {
    caf::anon_send_exit(members, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(job, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(registry, caf::exit_reason::user_shutdown);
    return fail("cannot listen on " + cli.listen + ": " + bound.message());
  }
  sh->jn.write("coordinator_started", {{"listen", bound.value()},
                                       {"job_id", job_id},
                                       {"store_port", store_port.value()},
                                       {"metrics_port", cli.metrics_port},
                                       {"resume_step", resume_step}});
  std::fprintf(stderr, "coordinator: job %s listening on %s, waiting for %lld node(s)\n", job_id.c_str(), bound.value().c_str(),
               static_cast<long long>(cfg.get_int("cluster.min_nodes")));

  int code = 0;
  {
    std::unique_lock<std::mutex> lock(sh->mu);
    while (!sh->finished) {
      sh->cv.wait_for(lock, std::chrono::milliseconds(100));
      if (cli.stop_signal && cli.stop_signal->load() != 0 && !sh->finished) {
        code = 128 + cli.stop_signal->load();
        break;
      }
    }
    if (sh->finished) code = sh->exit_code;
  }
  if (code >= 128) {
    // Interrupted: ranks stop at a step boundary they agree on, rank 0 sends
    // a final checkpoint (saved by the registry before the ranks' FINISHED
    // arrive), then every node is told to stop. Nodes leaving now (the same
    // signal reached them) are part of the stop: no new generation.
    caf::anon_send(members, stop_atom::value);
    caf::anon_send(job, stop_atom::value);
    const std::string reason = "coordinator stopped by signal " + std::to_string(code - 128);
    sh->jn.write("job_stopping", {{"reason", reason}});
    sh->obs->log("coordinator: " + reason + "; stopping the ranks after a final checkpoint");
    {
      auto env = make_envelope(header, last_plan_gen);
      env.mutable_shutdown()->set_reason(reason);
      env.mutable_shutdown()->set_checkpoint(true);
      std::lock_guard<std::mutex> lock(tap_mu);
      for (const auto& [peer, node] : peer_node) (void)bridge->send(links::nodes, peer, env);
    }
    std::unique_lock<std::mutex> lock(sh->mu);
    const bool stopped = last_plan_gen > 0 && sh->cv.wait_for(lock, std::chrono::seconds(30), [&] { return sh->finished; });
    if (!stopped) sh->jn.write("job_stopped", {{"reason", reason}, {"final_checkpoint", false}});
    lock.unlock();
    auto env = make_envelope(header, last_plan_gen);
    env.mutable_shutdown()->set_reason(reason);
    std::lock_guard<std::mutex> tap_lock(tap_mu);
    for (const auto& [peer, node] : peer_node) (void)bridge->send(links::nodes, peer, env);
  } else {
    // Finished (the job actor has also sent `shutdown`) or failed: tell every
    // node to stop.
    auto env = make_envelope(header, last_plan_gen);
    env.mutable_shutdown()->set_reason(code == 0 ? "job finished" : "job failed");
    std::lock_guard<std::mutex> lock(tap_mu);
    for (const auto& [peer, node] : peer_node) (void)bridge->send(links::nodes, peer, env);
  }
  // Sockets close with linger 0: give ZeroMQ a moment to put the shutdowns
  // on the wire (nodes that miss them notice the coordinator's silence).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  bridge_ptr.store(nullptr);
  bridge->stop();
  caf::anon_send_exit(members, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(job, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(registry, caf::exit_reason::user_shutdown);
  return code;
}

}  // namespace dtactor
