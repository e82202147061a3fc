// A rank process (started by its node agent, one per device): a small
// control actor that talks to the node over the bridge, and the training
// thread (model/rank_worker) that runs the generation's steps.
#include <malloc.h>
#include <sys/prctl.h>
#include <signal.h>
#include <unistd.h>

#include <caf/all.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "actors/messages.hpp"
#include "app/caf_setup.hpp"
#include "app/cluster.hpp"
#include "app/cluster_util.hpp"
#include "model/rank_worker.hpp"
#include "monitoring/data_wait.hpp"
#include "runtime/wire.hpp"
#include "runtime/zmq_bridge.hpp"

namespace dtactor {

namespace {

int fail(const std::string& msg, int code = 1) {
  std::fprintf(stderr, "dtactor: %s\n", msg.c_str());
  return code;
}

using report_atom = caf::atom_constant<caf::atom("report")>;

struct rank_actor_state {
  envelope_header header;
  std::function<void(pb::envelope)> send;
  std::unique_ptr<rank_worker> worker;
  rank_worker_options wopts;
  std::chrono::milliseconds heartbeat_interval{100};
  uint64_t heartbeat_seq = 0;
  uint64_t newest_plan = 0;
  static inline const char* name = "dtactor.rank";
};

using rank_self = caf::stateful_actor<rank_actor_state>*;

// Control side of a rank: relays plans and stops to the training thread,
// its reports (stamped with their generation) to the node, and heartbeats
// the node every interval so it can tell a hung rank from a busy one.
caf::behavior rank_actor(rank_self self, envelope_header header, rank_worker_options wopts, std::function<void(pb::envelope)> send) {
  auto& st = self->state;
  st.header = std::move(header);
  st.wopts = std::move(wopts);
  st.send = std::move(send);
  auto relay = [self](uint64_t gen, pb::envelope env) {
    caf::anon_send(caf::actor_cast<caf::actor>(self), report_atom::value, gen, inbound{"node", "", std::move(env)});
  };
  // Each callback puts its message into the matching body of an envelope.
  auto into = [relay](auto mutable_body) {
    return [relay, mutable_body](uint64_t gen, auto msg) {
      pb::envelope e;
      *(e.*mutable_body)() = std::move(msg);
      relay(gen, std::move(e));
    };
  };
  rank_worker_callbacks cb;
  cb.on_step = into(&pb::envelope::mutable_step_report);
  cb.on_eval = into(&pb::envelope::mutable_eval_report);
  cb.on_checkpoint = into(&pb::envelope::mutable_checkpoint_data);
  cb.on_status = into(&pb::envelope::mutable_rank_status);
  st.worker = std::make_unique<rank_worker>(st.wopts, std::move(cb));
  return {
      [=](start_atom) {
        auto& st = self->state;
        pb::envelope hello = make_envelope(st.header, 0);
        hello.mutable_rank_hello()->set_local_rank(st.wopts.local_rank);
        hello.mutable_rank_hello()->set_pid(static_cast<int32_t>(::getpid()));
        st.send(std::move(hello));
        self->send(self, tick_atom::value);
      },
      [=](tick_atom) {
        auto& st = self->state;
        pb::envelope hb = make_envelope(st.header, st.newest_plan);
        hb.mutable_heartbeat()->set_seq(++st.heartbeat_seq);
        st.send(std::move(hb));
        self->delayed_send(self, st.heartbeat_interval, tick_atom::value);
      },
      [=](report_atom, uint64_t gen, inbound& in) {
        auto& st = self->state;
        pb::envelope env = make_envelope(st.header, gen);
        env.MergeFrom(in.env);
        env.set_generation(gen);
        if (env.has_step_report()) env.mutable_step_report()->set_data_wait_s(take_data_wait_s());
        st.send(std::move(env));
      },
      [=](inbound& in) {
        auto& st = self->state;
        if (in.env.has_generation_plan()) {
          if (!in.env.job_id().empty()) st.header.job_id = in.env.job_id();
          if (st.worker->offer(in.env.generation_plan())) st.newest_plan = std::max(st.newest_plan, in.env.generation_plan().generation());
        } else if (in.env.has_shutdown()) {
          if (in.env.shutdown().checkpoint()) {
            st.worker->request_stop(true);
            return;
          }
          st.worker->quit();
          self->quit();
        }
      },
  };
}

}  // namespace

int run_rank(const cluster_cli& cli) {
  // One malloc arena for the whole process. The training thread is not this
  // process's main thread, so glibc would give it an arena of its own, made
  // of 64 MiB heaps: a step's largest activations did not fit the first
  // heap, and every step glibc mapped a second one, touched ~9 MiB of it and
  // unmapped it again when the step freed them (strace: 2 heaps created and
  // deleted per step; ~3,000 page faults per step against ~250 for `train`,
  // whose loop runs on the main thread's brk heap). A 1-rank runtime ran 8%
  // below the same build with GLIBC_TUNABLES=glibc.malloc.arena_max=1
  // (bench_runtime --baseline-bin, docs/data_parallel.md). The other threads
  // here (CAF, ZeroMQ, Gloo) allocate little, so sharing the lock costs
  // nothing measurable. A user's own arena_max tunable wins.
  if (const char* t = std::getenv("GLIBC_TUNABLES"); !t || !std::strstr(t, "arena_max")) ::mallopt(M_ARENA_MAX, 1);
  // A rank never outlives its node agent (kill -9 of a node takes its ranks).
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) return fail("rank started without a node agent");
  if (cli.node_endpoint.empty()) return fail("--role rank is started by a node agent (needs --node-endpoint)", 2);

  rank_worker_options w;
  w.node_id = cli.node_id;
  w.local_rank = cli.local_rank;
  w.local_world = cli.nproc_per_node;
  w.threads = cli.threads_per_rank;
  w.advertise_addr = cli.advertise_addr;
  w.fail_at_step = cli.fail_at_step;
  w.fail_mode = cli.fail_mode;
  // An empty store host in the plan means: the coordinator's host as this node reaches it.
  if (auto c = parse_tcp_endpoint(cli.coordinator, "--coordinator")) w.default_store_host = c->host;

  envelope_header header;
  header.sender = "rank/" + cli.node_id + "/" + std::to_string(cli.local_rank);
  header.incarnation = wire::new_incarnation();

  caf::actor_system_config sys_cfg;
  configure_caf(sys_cfg, 1);
  caf::actor_system sys{sys_cfg};

  // The actor first (it only sends after start_atom), then the bridge that
  // feeds it; start_atom orders the bridge's creation before any send.
  std::unique_ptr<zmq_bridge> bridge;
  auto send = [&bridge](pb::envelope env) { (void)bridge->send("node", "", env); };
  caf::actor actor = sys.spawn(rank_actor, header, w, send);
  bridge = std::make_unique<zmq_bridge>(zmq_bridge_options{}, [actor](const std::string& link, const std::string& peer, pb::envelope env) {
    caf::anon_send(actor, inbound{link, peer, std::move(env)});
  });
  if (auto r = bridge->add_dealer("node", cli.node_endpoint, header.sender + "/" + std::to_string(header.incarnation)); !r) {
    caf::anon_send_exit(actor, caf::exit_reason::user_shutdown);
    return fail("cannot reach the node agent at " + cli.node_endpoint + ": " + r.message());
  }
  caf::anon_send(actor, start_atom::value);
  {
    caf::scoped_actor self{sys};
    self->monitor(actor);
    self->receive([](const caf::down_msg&) {});
  }
  // Let the last reports leave (sockets close with linger 0).
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  bridge->stop();
  // _Exit: groups parked mid-collective must not be destroyed (their
  // destructors wait out Gloo's timeout), and nothing else needs flushing.
  std::fflush(stderr);
  std::_Exit(0);
}

}  // namespace dtactor
