// A rank process (started by its node agent, one per device), as wiring:
// the rank actor (actors/rank_actor) that talks to the node over the
// bridge, and the training thread (rank/rank_worker) it drives.
#include <chrono>
#include <csignal>
#include <atomic>
#include <malloc.h>
#include <sys/prctl.h>
#include <signal.h>
#include <unistd.h>

#include <caf/all.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "actors/messages.hpp"
#include "actors/rank_actor.hpp"
#include "app/caf_setup.hpp"
#include "app/cluster.hpp"
#include "app/cluster_util.hpp"
#include "rank/rank_worker.hpp"
#include "net/wire.hpp"
#include "net/zmq_bridge.hpp"

namespace dtactor {

namespace {

int fail(const std::string& msg, int code = 1) {
  std::fprintf(stderr, "dtactor: %s\n", msg.c_str());
  return code;
}

// Set by SIGUSR2, the node agent's "leave now" (node.cpp's launcher).
std::atomic<int> g_leave{0};
extern "C" void on_leave_signal(int sig) { g_leave.store(sig); }

// The process's malloc settings for a training step (the user's own
// GLIBC_TUNABLES win). Returns whether the user set the mmap threshold.
bool tune_malloc() {
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
  // Buffers a step allocates and frees again stay mapped for the next step.
  // With train.zero = 2 over Gloo a step allocates each bucket's buffers and
  // its all-to-all's send, receive and sum buffers while the bucket is in
  // flight (at most about 64 MB of buckets at once): glibc gave the top of
  // the heap back to the kernel whenever more than twice its mmap threshold
  // was free there, and mapped fresh pages the next step, so a rank spent
  // ~15% of its time in page faults and clearing pages (perf). With these,
  // the 202M GPT at world 4 (2 nodes x 2 ranks, Gloo) took 6.41 s a step
  // against 8.95 s, zero = 0's unchanged (4.43 against 4.47 s; README). The
  // heap keeps its peak within a step, which the step reaches anyway.
  // Allocations above 32 MiB (glibc's largest mmap threshold) are still
  // mapped and unmapped on their own. A user's own tunables win.
  const bool own_mmap_threshold = [] {
    const char* t = std::getenv("GLIBC_TUNABLES");
    return t && std::strstr(t, "mmap_threshold");
  }();
  if (!own_mmap_threshold) ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
  if (const char* t = std::getenv("GLIBC_TUNABLES"); !t || !std::strstr(t, "trim_threshold")) ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  return own_mmap_threshold;
}

// The training thread's options, from the node agent's command line.
// `own_mmap_threshold`: the user's, which the worker then leaves alone.
rank_worker_options worker_options(const cluster_cli& cli, bool own_mmap_threshold) {
  rank_worker_options w;
  w.node_id = cli.node_id;
  // A warm spare has no slot until its node gives it one (spare_slot).
  w.local_rank = cli.spare ? -1 : cli.local_rank;
  w.local_world = cli.nproc_per_node;
  w.threads = cli.threads_per_rank;
  w.advertise_addr = cli.advertise_addr;
  w.fail_at_step = cli.fail_at_step;
  w.fail_mode = cli.fail_mode;
  // While the training state is built, a tensor of 1 MiB or more gets a
  // mapping of its own: the module's parameters (16 MB each for a GPT MLP
  // weight) are freed as the optimizer's flat buffers take their place, and
  // under the 32 MiB threshold they stayed on the heap until the trim after
  // set-up, 4 bytes a parameter above the state at that moment.
  if (!own_mmap_threshold) {
    w.setup_mmap_threshold = 1 << 20;
    w.step_mmap_threshold = 32 << 20;
  }
  w.key = cli.key;
  // An empty store host in the plan means: the coordinator's host as this node reaches it.
  // (With several coordinator addresses, the first: coordinators that take
  // over from each other name their store's host in the plan, --advertise-addr.)
  if (auto c = parse_tcp_endpoints(cli.coordinator, "--coordinator")) w.default_store_host = c->front().host;
  return w;
}

// Blocks until the rank actor is down, telling it to leave once SIGUSR2 came.
void wait_for_the_actor(caf::actor_system& sys, const rank_actor_handle& actor) {
  // SIGUSR2 is how the node agent ends a rank (after the drain that took
  // it out of the generation, or when the node goes): leave at once. The
  // agent kills a rank that is still there after its grace period.
  // SIGTERM/SIGINT/SIGUSR1 (a scheduler signalling the whole process
  // tree) only set the stop flag: the node decides how its ranks stop.
  caf::scoped_actor self{sys};
  self->monitor(actor);
  bool down = false, told = false;
  while (!down)
    self->receive([&](const caf::down_msg&) { down = true; },
                  caf::after(std::chrono::milliseconds(20)) >> [&] {
                    if (!told && g_leave.load() != 0) {
                      told = true;
                      caf::anon_send_exit(actor, caf::exit_reason::user_shutdown);
                    }
                  });
}

}  // namespace

int run_rank(const cluster_cli& cli) {
  const bool own_mmap_threshold = tune_malloc();
  // A rank never outlives its node agent (kill -9 of a node takes its ranks).
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  std::signal(SIGUSR2, on_leave_signal);
  if (::getppid() == 1) return fail("rank started without a node agent");
  if (cli.node_endpoint.empty()) return fail("--role rank is started by a node agent (needs --node-endpoint)", 2);

  const rank_worker_options w = worker_options(cli, own_mmap_threshold);

  envelope_header header;
  // A spare's "rank/<node>/-1" names no rank: its node goes by the
  // connection, and nothing a spare sends before it has a slot is relayed.
  header.sender = sender_id::of_rank(cli.node_id, w.local_rank).to_string();
  header.incarnation = wire::new_incarnation();

  caf::actor_system_config sys_cfg;
  configure_caf(sys_cfg, 1);
  caf::actor_system sys{sys_cfg};

  // The actor first (it only sends after start_atom), then the bridge that
  // feeds it; start_atom orders the bridge's creation before any send.
  std::unique_ptr<zmq_bridge> bridge;
  auto send = [&bridge](pb::envelope env) { (void)bridge->send("node", "", env); };
  rank_actor_options ro;
  ro.header = header;
  ro.node_id = cli.node_id;
  ro.local_rank = w.local_rank;
  ro.pid = static_cast<int32_t>(::getpid());
  ro.send = send;
  ro.make_work = [w](rank_work_callbacks cb) -> std::unique_ptr<rank_work> { return std::make_unique<rank_worker>(w, std::move(cb)); };
  rank_actor_handle actor = sys.spawn(rank_actor, ro);
  zmq_bridge_options bo;
  bo.key = cli.key;
  bridge = std::make_unique<zmq_bridge>(bo, [actor](const std::string& link, const std::string& peer, pb::envelope env) {
    caf::anon_send(actor, inbound{link, peer, std::move(env)});
  });
  if (auto r = bridge->add_dealer("node", cli.node_endpoint, header.sender + "/" + std::to_string(header.incarnation)); !r) {
    caf::anon_send_exit(actor, caf::exit_reason::user_shutdown);
    return fail("cannot reach the node agent at " + cli.node_endpoint + ": " + r.message());
  }
  caf::anon_send(actor, start_atom::value);
  wait_for_the_actor(sys, actor);
  // The last reports (FINISHED, a failure) leave before the socket closes;
  // a node agent that is gone does not hold the exit up past the deadline.
  bridge->stop(std::chrono::seconds(1));
  // _Exit: groups parked mid-collective must not be destroyed (their
  // destructors wait out Gloo's timeout), and nothing else needs flushing.
  std::fflush(stderr);
  std::_Exit(0);
}

}  // namespace dtactor
