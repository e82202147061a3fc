// Writes the seed corpus of the fuzz targets that take dtactor's own
// formats (fuzz/corpus/<target>/seed-*; docs/fuzzing.md), from real code
// paths: an in-process run of the real coordinator, node and rank actors
// (two nodes of two ranks, CAF's test coordinator, fuzz/actors_fixture.hpp)
// whose frames are recorded as the bridges would send them, through
// warm-up, a generation, steps, an evaluation, a checkpoint committed by
// the real committer, a node leaving on a preemption notice, a drain
// generation and the end; the journal the coordinator's sink wrote; a
// manifest written by checkpoint_store::commit; the ZAP requests libzmq
// sends for real CURVE handshakes; a key file from dtactor keygen's code;
// rendezvous requests as rendezvous_client sends them; the config as
// `dtactor config` prints it.
//
// Usage: fuzz_make_seeds CORPUS_DIR (fuzz/make_corpus.sh runs it).
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "fuzz/actors_fixture.hpp"
#include "base/job_key.hpp"
#include "net/rendezvous_protocol.hpp"
#include "net/wire.hpp"
#include "net/zap_handler.hpp"

using namespace dtactor;
namespace fs = std::filesystem;

namespace {

std::string out_dir;

void write_seed(const std::string& target, const std::string& name, const std::string& bytes) {
  const fs::path dir = fs::path(out_dir) / target;
  fs::create_directories(dir);
  std::ofstream f(dir / ("seed-" + name), std::ios::binary);
  f << bytes;
  if (!f) fuzz::fail(("cannot write a seed of " + target).c_str());
}

// A conversation as one fuzz target replays it: records, with the clock's
// moves in between.
struct conversation {
  std::string records;
  clock_time last{};
  void at(clock_time now) {
    if (last == clock_time{}) last = now;
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - last).count();
    last = now;
    while (ms > 0) {
      const auto step = std::min<int64_t>(ms, 4000);
      std::string p(2, '\0');
      p[0] = static_cast<char>(step & 0xff);
      p[1] = static_cast<char>(step >> 8);
      fuzz::put_record(records, time_tag, p);
      ms -= step;
    }
  }
  uint8_t time_tag = 1;
};

// The training thread of a rank, scripted: warm-up, READY, a step every
// 50 ms, an evaluation and a checkpoint at step 6, FINISHED at max_steps.
struct scripted_work : rank_work {
  rank_work_callbacks cb;
  std::string node_id;
  int32_t local = 0;
  fuzz::memory_store* store = nullptr;
  std::optional<pb::generation_plan> plan;
  int32_t global = -1;
  int64_t step = 0;
  bool finished = false, stop_asked = false;
  std::function<void(uint64_t, const pb::envelope&)> on_report;  // records node-a rank 0's reports
  std::function<void()> on_gone;                                  // the rank actor's state (and this) goes
  ~scripted_work() override {
    if (on_gone) on_gone();
  }

  void report(uint64_t gen, pb::envelope body) {
    if (on_report) on_report(gen, body);
    if (body.has_rank_status()) cb.on_status(gen, body.rank_status());
    if (body.has_step_report()) cb.on_step(gen, body.step_report());
    if (body.has_eval_report()) cb.on_eval(gen, body.eval_report());
    if (body.has_checkpoint_written()) cb.on_checkpoint(gen, body.checkpoint_written());
  }
  pb::envelope status(pb::rank_status::state s, const std::string& detail = "") {
    pb::envelope e;
    auto* st = e.mutable_rank_status();
    st->set_status(s);
    st->set_local_rank(local);
    st->set_global_rank(global);
    st->set_step(step);
    st->set_detail(detail);
    return e;
  }
  bool offer(const pb::generation_plan& p) override {
    if (plan && p.generation() <= plan->generation()) return false;
    plan = p;
    global = -1;
    for (const auto& r : p.ranks())
      if (r.node_id() == node_id && r.local_rank() == local) global = r.global_rank();
    if (p.generation() == 0 || global < 0) {
      auto idle = status(pb::rank_status::STATE_IDLE, p.generation() == 0 ? "warmed up" : "not in generation " + std::to_string(p.generation()));
      (*idle.mutable_rank_status()->mutable_data_digests())["/data/train.npy"] = "47040016:9f2c4e1a0b7d3e55";
      report(p.generation(), idle);
      return true;
    }
    step = std::max(step, p.start_step());
    auto ready = status(pb::rank_status::STATE_READY);
    ready.mutable_rank_status()->set_state_source(p.generation() == 1 ? pb::rank_status::ORIGIN_FRESH : pb::rank_status::ORIGIN_LOCAL);
    ready.mutable_rank_status()->set_state_root(p.state_root());
    ready.mutable_rank_status()->set_switch_s(0.012);
    report(p.generation(), ready);
    return true;
  }
  void request_stop(bool) override { stop_asked = true; }
  void quit() override {}
  void take_slot(int32_t l) override { local = l; }

  // One step of the current generation (called every 50 ms of the clock).
  void tick() {
    if (!plan || plan->generation() == 0 || global < 0 || finished) return;
    const uint64_t gen = plan->generation();
    const int32_t world = plan->world_size();
    ++step;
    pb::envelope s;
    auto* r = s.mutable_step_report();
    r->set_step(step);
    r->set_global_rank(global);
    r->set_world_size(world);
    r->set_loss(2.3 / static_cast<double>(step));
    r->set_step_s(0.036);
    r->set_allreduce_s(0.004);
    r->set_allreduce_exposed_s(0.001);
    r->set_samples(128 / world);
    r->set_lr(0.001);
    r->set_steps_covered(1);
    r->set_param_bytes(820000);
    r->set_grad_bytes(820000);
    r->set_optimizer_state_bytes(1640000);
    if (step % 4 == 0) r->set_params_digest("3b2f9c0e11aa5d77");
    report(gen, s);
    if (step == 6 && global == 0) {
      pb::envelope e;
      auto* ev = e.mutable_eval_report();
      ev->set_step(step);
      (*ev->mutable_metrics())["accuracy"] = 0.7125;
      (*ev->mutable_metrics())["val_loss"] = 0.8311;
      ev->add_examples("T-shirt -> T-shirt");
      ev->set_duration_s(0.4);
      report(gen, e);
    }
    if (step == 6) write_checkpoint(gen, world);
    if (step >= 12 || stop_asked) {
      finished = true;
      report(gen, status(pb::rank_status::STATE_FINISHED, "3b2f9c0e11aa5d77"));
    }
  }

  // Each rank stores its range of a 16 KiB state, as part_writer does; rank
  // 0's report carries the manifest body.
  void write_checkpoint(uint64_t gen, int32_t world) {
    const uint64_t state_bytes = 16384;
    const auto [a, b] = part_range(state_bytes, global, world);
    std::string bytes(static_cast<size_t>(b - a), '\0');
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((a + i) * 31 % 251);
    pb::envelope e;
    auto* w = e.mutable_checkpoint_written();
    w->set_step(step);
    w->set_global_rank(global);
    w->set_world_size(world);
    w->set_stall_s(0.002);
    auto part = write_part(*store, part_name(step, gen, global, world), a, bytes.data(), bytes.size());
    if (!part) fuzz::fail(part.message().c_str());
    part->set_rank(global);
    part->set_node_id(node_id);
    *w->add_parts() = part.value();
    w->set_write_s(0.01);
    if (global == 0) {
      pb::checkpoint_meta meta;
      meta.set_format_version(checkpoint_format_version);
      meta.set_model("vit");
      meta.set_step(step);
      meta.set_arch_digest(fuzz::job_config().digest({"model."}));
      meta.set_config_digest(fuzz::job_config().digest());
      meta.set_seed(1234);
      meta.set_global_batch_size(128);
      meta.set_samples_seen(step * 128);
      (*meta.mutable_metrics())["accuracy"] = 0.7125;
      meta.set_unix_time(1.76e9);
      meta.set_config_toml(fuzz::job_config().to_toml());
      auto* t = meta.add_tensors();
      t->set_name("model/patch.weight");
      t->set_dtype("float32");
      t->add_shape(64);
      t->add_shape(63);
      t->set_offset(0);
      t->set_size(16128);
      auto* t2 = meta.add_tensors();
      t2->set_name("train/step");
      t2->set_dtype("int64");
      t2->add_shape(1);
      t2->set_offset(16128);
      t2->set_size(8);
      meta.set_state_bytes(state_bytes);
      meta.set_world_size(world);
      w->set_meta(meta.SerializeAsString());
    }
    report(gen, e);
  }
};

// The run: a coordinator, node-a and node-b, two ranks each.
struct cluster_run {
  test_support::caf_fixture fx;
  std::vector<std::string> frames;  // every frame, encoded
  conversation to_coordinator, to_node_a, to_rank_a0;
  std::unique_ptr<fuzz::coordinator_actors> coord;
  std::map<std::string, node_agent_handle> agents;                           // node id -> agent
  std::map<std::string, std::shared_ptr<fuzz::fake_launcher>> launchers;     // node id -> launcher
  std::map<std::pair<std::string, int32_t>, rank_actor_handle> ranks;        // (node, local) -> rank actor
  std::map<std::pair<std::string, int32_t>, scripted_work*> works;

  static std::string peer_of(const std::string& node) { return node == "node-a" ? "peer-0" : "peer-1"; }
  static uint8_t peer_tag(const std::string& node) { return node == "node-a" ? 0 : 4; }

  std::string encode(const pb::envelope& env) {
    auto bytes = wire::encode(env);
    if (!bytes) fuzz::fail(bytes.message().c_str());
    frames.push_back(bytes.value());
    return bytes.value();
  }
  static pb::envelope decode(const std::string& bytes, std::string_view job) {
    auto d = wire::decode(bytes, job);
    if (!d) fuzz::fail(d.message().c_str());
    return std::move(d.value());
  }

  explicit cluster_run(const std::string& journal_path) {
    to_node_a.time_tag = 2;
    to_rank_a0.time_tag = 2;
    outbound from_coordinator = [this](const std::string&, const std::string& peer, pb::envelope env) {
      const std::string bytes = encode(env);
      const std::string node = peer == "peer-0" ? "node-a" : "node-b";
      if (node == "node-a") {
        to_node_a.at(fx.now());
        fuzz::put_record(to_node_a.records, 0, bytes);
      }
      caf::anon_send(agents.at(node), inbound{links::coordinator, "", decode(bytes, "")});
    };
    coord = std::make_unique<fuzz::coordinator_actors>(fx, from_coordinator, journal_path);
    for (const std::string node : {"node-a", "node-b"}) {
      auto launcher = std::make_shared<fuzz::fake_launcher>(node == "node-a" ? 1000 : 2000);
      launcher->on_spawn = [this, node](int32_t local, int32_t pid) { start_rank(node, local, pid); };
      outbound from_node = [this, node](const std::string& link, const std::string& peer, pb::envelope env) {
        const std::string bytes = encode(env);
        if (link == links::coordinator) {
          to_coordinator.at(fx.now());
          fuzz::put_record(to_coordinator.records, peer_tag(node), bytes);
          caf::anon_send(coord->members, inbound{links::nodes, peer_of(node), decode(bytes, fuzz::job_id)});
        } else {
          const int32_t local = std::stoi(peer.substr(peer.rfind('-') + 1));
          if (node == "node-a" && local == 0) {
            to_rank_a0.at(fx.now());
            fuzz::put_record(to_rank_a0.records, 0, bytes);
          }
          if (auto it = ranks.find({node, local}); it != ranks.end()) caf::anon_send(it->second, inbound{"node", "", decode(bytes, "")});
        }
      };
      auto agent = fx.spawn(node_agent, fuzz::node_options(node), from_node, launcher);
      launcher->agent = agent;
      agents[node] = agent;
      launchers[node] = launcher;
    }
  }

  ~cluster_run() {
    for (auto& [key, w] : works) w->on_gone = nullptr;  // the map goes before the actors
  }

  void start_rank(const std::string& node, int32_t local, int32_t pid) {
    const std::string peer = "rank-peer-" + std::to_string(local);
    auto send = [this, node, local, peer](pb::envelope env) {
      const std::string bytes = encode(env);
      if (node == "node-a") {
        to_node_a.at(fx.now());
        fuzz::put_record(to_node_a.records, static_cast<uint8_t>(1 | (local << 2)), bytes);
      }
      caf::anon_send(agents.at(node), inbound{links::ranks, peer, decode(bytes, "")});
    };
    auto make_work = [this, node, local](rank_work_callbacks cb) -> std::unique_ptr<rank_work> {
      auto w = std::make_unique<scripted_work>();
      w->cb = std::move(cb);
      w->node_id = node;
      w->local = local;
      w->store = coord->objects.get();
      if (node == "node-a" && local == 0)
        w->on_report = [this](uint64_t gen, const pb::envelope& body) {
          to_rank_a0.at(fx.now());
          fuzz::put_record(to_rank_a0.records, static_cast<uint8_t>(1 | (std::min<uint64_t>(gen, 63) << 2)), body.SerializeAsString());
        };
      works[{node, local}] = w.get();
      w->on_gone = [this, node, local] { works.erase({node, local}); };
      return w;
    };
    auto r = fx.spawn(rank_actor, fuzz::rank_options(node, local, pid, send, make_work));
    ranks[{node, local}] = r;
    caf::anon_send(r, start_atom::value);
  }

  // The clock moves by `total`; the ranks step every 50 ms.
  void run_for(std::chrono::milliseconds total) {
    for (auto done = std::chrono::milliseconds(0); done < total; done += std::chrono::milliseconds(50)) {
      fx.advance(std::chrono::milliseconds(50));
      for (auto& [key, w] : std::map(works)) w->tick();
      fx.run();
    }
  }
};

// Real frames and conversations from one run.
void actor_seeds() {
  const std::string journal_path = (fs::temp_directory_path() / "dtactor-fuzz-seeds-journal.jsonl").string();
  fs::remove(journal_path);
  {
    cluster_run run(journal_path);
    for (const auto& [node, agent] : run.agents) caf::anon_send(agent, start_atom::value);
    run.fx.run();
    run.run_for(std::chrono::milliseconds(600));  // registration, warm-up, generation 1, 6 steps and the checkpoint
    const std::string registration_a = run.to_node_a.records, registration_c = run.to_coordinator.records;
    // node-b leaves on a preemption notice: a drain generation without it.
    caf::anon_send(run.agents.at("node-b"), leave_atom::value, std::string("preemption notice (aws)"), std::string("aws"),
                   std::string("2030-01-01T00:02:00Z"), 1.8934560e9, 1.8934559e9);
    run.run_for(std::chrono::milliseconds(1500));
    run.coord->scrape();
    write_seed("coordinator", "run", run.to_coordinator.records);
    write_seed("coordinator", "start", registration_c);
    write_seed("node_agent", "run", run.to_node_a.records);
    write_seed("node_agent", "start", registration_a);
    write_seed("rank_actor", "run", run.to_rank_a0.records);
    // Every kind of frame, twice at most.
    std::map<std::string, int> kinds;
    for (const auto& bytes : run.frames) {
      auto d = wire::decode(bytes, "");
      const std::string kind = wire::body_name(d.value());
      if (kinds[kind]++ < 2) write_seed("wire_envelope", kind + "-" + std::to_string(kinds[kind]), bytes);
    }
    std::fprintf(stderr, "make_seeds: %zu frames of %zu kinds; conversations: coordinator %zu B, node %zu B, rank %zu B\n", run.frames.size(),
                 kinds.size(), run.to_coordinator.records.size(), run.to_node_a.records.size(), run.to_rank_a0.records.size());
    // The journal the coordinator's sink wrote, as `dtactor report` reads it.
  }
  std::ifstream j(journal_path, std::ios::binary);
  std::string journal((std::istreambuf_iterator<char>(j)), std::istreambuf_iterator<char>());
  if (journal.empty()) fuzz::fail("the run wrote no journal");
  write_seed("journal_report", "cluster-run", journal);
  fs::remove(journal_path);
}

// A manifest as checkpoint_store::commit writes it, unsigned and signed
// (the fuzz target's key), with its part.
void manifest_seeds() {
  for (bool sign : {false, true}) {
    auto objects = std::make_shared<fuzz::memory_store>();
    set_checkpoint_mac_key(sign ? std::string(32, 'k') : std::string());
    auto store = checkpoint_store::over(objects, checkpoint_policy{});
    std::string bytes(64, '\0');
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7);
    auto part = write_part(*objects, part_name(7, 3, 0, 1), 0, bytes.data(), bytes.size());
    pb::checkpoint_meta meta;
    meta.set_model("vit");
    meta.set_step(7);
    meta.set_generation(3);
    meta.set_seed(1234);
    meta.set_global_batch_size(128);
    meta.set_samples_seen(896);
    (*meta.mutable_metrics())["accuracy"] = 0.5;
    meta.set_config_toml("[model]\nname = \"vit\"\n");
    auto* t = meta.add_tensors();
    t->set_name("model/w");
    t->set_dtype("float32");
    t->add_shape(4);
    t->add_shape(4);
    t->set_size(64);
    *meta.add_parts() = part.value();
    meta.set_state_bytes(64);
    meta.set_world_size(1);
    auto done = store.commit(meta);
    if (!done) fuzz::fail(done.message().c_str());
    std::string seed;
    fuzz::put_record(seed, sign ? 1 : 0, objects->objects.at(manifest_name(7)));
    fuzz::put_record(seed, 0, part_name(7, 3, 0, 1) + std::string(1, '\0') + bytes);
    write_seed("checkpoint_manifest", sign ? "signed" : "unsigned", seed);
  }
  set_checkpoint_mac_key("");
}

// What libzmq asks a ZAP handler during real CURVE handshakes: the job's
// client, and a client with another key.
void zap_seeds() {
  auto key = generate_job_key();
  auto other = generate_job_key();
  if (!key || !other) fuzz::fail("no CURVE here");
  zmq::context_t ctx;
  zmq::socket_t zap(ctx, zmq::socket_type::rep);
  zap.bind("inproc://zeromq.zap.01");
  zmq::socket_t server(ctx, zmq::socket_type::router);
  make_curve_server(server, key->server_secret);
  server.bind("tcp://127.0.0.1:*");
  const std::string ep = server.get(zmq::sockopt::last_endpoint);
  int n = 0;
  for (const auto* k : {&key.value(), &other.value()}) {
    zmq::socket_t client(ctx, zmq::socket_type::dealer);
    make_curve_client(client, key->server_public, k->client_public, k->client_secret);
    client.set(zmq::sockopt::linger, 0);
    client.connect(ep);
    zmq::multipart_t request;
    zmq::pollitem_t item{static_cast<void*>(zap), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(5000)) <= 0 || !request.recv(zap)) fuzz::fail("libzmq asked no ZAP question");
    std::string seed;
    std::vector<std::string> frames;
    for (const auto& f : request) {
      frames.push_back(f.to_string());
      fuzz::put_record(seed, 0, f.to_string());
    }
    // The fuzz target's allow-list holds 32 x 'k': the job's client as it sees it.
    if (k == &key.value()) {
      std::string allowed_seed;
      frames[6] = std::string(32, 'k');
      for (const auto& f : frames) fuzz::put_record(allowed_seed, 0, f);
      write_seed("zap_request", "curve-allowed", allowed_seed);
    }
    write_seed("zap_request", "curve-" + std::to_string(n++), seed);
    zmq::multipart_t reply;
    for (const auto& f : decide_zap_request(frames, {curve_key_binary(key->client_public)}).reply) reply.addstr(f);
    reply.send(zap);
  }
}

void key_seeds() {
  auto key = generate_job_key();
  const fs::path path = fs::temp_directory_path() / "dtactor-fuzz-seed.key";
  fs::remove(path);
  if (!key || !write_job_key(path.string(), key.value())) fuzz::fail("cannot write a key file");
  std::ifstream f(path, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  fs::remove(path);
  write_seed("job_key", "keygen", text);
}

// Requests as rendezvous_client (a c10d::Store) sends them while ranks build
// a Gloo group: set, get, add, check, wait, cas, del, num; and the clock.
void rendezvous_seeds() {
  uint64_t id = 1;
  auto request = [&](std::string& seed, const std::string& peer, std::vector<std::string> frames) {
    fuzz::put_record(seed, 1, peer);
    fuzz::put_record(seed, 1, rendezvous_protocol::encode_id(id++));
    for (size_t i = 0; i < frames.size(); ++i) fuzz::put_record(seed, i + 1 == frames.size() ? 0 : 1, frames[i]);
  };
  std::string group;
  request(group, "rank0", {"set", "g1/rank_0", std::string("\x0a\x00\x00\x02\x70\x49", 6)});
  request(group, "rank1", {"get", "g1/rank_0", "60000"});
  request(group, "rank1", {"add", "g1/barrier", "1"});
  request(group, "rank0", {"add", "g1/barrier", "1"});
  request(group, "rank0", {"wait", "60000", "g1/rank_1"});
  request(group, "rank1", {"set", "g1/rank_1", "addr"});
  fuzz::put_record(group, 2, std::string("\x32\x00", 2));
  request(group, "rank0", {"check", "g1/rank_0", "g1/rank_1"});
  request(group, "rank0", {"cas", "g1/leader", "", "rank0"});
  request(group, "rank1", {"del", "g1/barrier"});
  request(group, "rank1", {"num"});
  fuzz::put_record(group, 2, std::string("\x60\xea", 2));
  write_seed("rendezvous_request", "gloo-group", group);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  out_dir = argv[1];
  actor_seeds();
  manifest_seeds();
  zap_seeds();
  key_seeds();
  rendezvous_seeds();
  // What `dtactor config` prints and the coordinator sends in register_ack.
  write_seed("config_toml", "defaults", config{}.to_toml());
  write_seed("config_toml", "fuzz-job", fuzz::job_config().to_toml());
  return 0;
}
