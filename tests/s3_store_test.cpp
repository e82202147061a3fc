// The S3 store against a real S3 server that checks SigV4 signatures
// (tests/rgw_env.hpp: Ceph's radosgw, started once for this program;
// without Ceph's packages every test here is skipped, saying so).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <optional>
#include <thread>
#include <csignal>

#include "storage/checkpoint_store.hpp"
#include "storage/leader_lease.hpp"
#include "base/process.hpp"
#include "storage/s3_store.hpp"
#include "net/zmq_bridge.hpp"
#include "chaos_checks.hpp"
#include "rgw_env.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::events;
using testing::read_journal;

std::string file_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

using testing::kAccess;
using testing::kSecret;
using testing::open_ok;
using testing::opts;
using testing::rgw;

std::string bytes_of(size_t n, int seed) { return testing::random_bytes(n, seed); }

TEST(s3_store, objects_round_trip_small_and_multipart_with_ranged_reads) {
  NEED_RGW();
  auto store = open_ok(opts("round-trip"));
  ASSERT_TRUE(store);
  EXPECT_EQ(store->location(), "s3://round-trip/p");
  ASSERT_TRUE(store->put("small", "hello"));
  EXPECT_EQ(store->get("small").value(), "hello");
  // 12 MiB + 3 bytes: three parts of a multipart upload (5 MiB parts), fed
  // in odd-sized writes.
  const std::string big = bytes_of((12u << 20) + 3, 1);
  auto w = store->create("big");
  ASSERT_TRUE(w);
  for (size_t at = 0; at < big.size();) {
    const size_t n = std::min<size_t>(big.size() - at, 3'000'001);
    ASSERT_TRUE(w.value()->write(big.data() + at, n));
    at += n;
  }
  EXPECT_FALSE(store->size_of("big").value().has_value()) << "nothing appears before commit";
  auto committed = w.value()->commit();
  ASSERT_TRUE(committed) << committed.message();
  EXPECT_EQ(store->size_of("big").value().value(), big.size());
  std::string back(1000, '\0');
  auto n = store->read("big", (5u << 20) - 500, back.data(), back.size());
  ASSERT_TRUE(n) << n.message();
  EXPECT_EQ(n.value(), 1000u);
  EXPECT_EQ(back, big.substr((5u << 20) - 500, 1000));
  n = store->read("big", big.size() - 2, back.data(), back.size());
  ASSERT_TRUE(n);
  EXPECT_EQ(n.value(), 2u) << "a read past the end returns what is there";
  EXPECT_EQ(store->get("big").value(), big);
  auto listed = store->list();
  ASSERT_TRUE(listed);
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].name, "big");
  EXPECT_EQ((*listed)[0].size, big.size());
  ASSERT_TRUE(store->remove("big"));
  ASSERT_TRUE(store->remove("big")) << "removing what is gone is fine";
  EXPECT_FALSE(store->size_of("big").value().has_value());
  auto missing = store->read("nope", 0, back.data(), 10);
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.message(), "cannot read 's3://round-trip/p/nope': no such object");
}

TEST(s3_store, a_writer_dropped_before_commit_leaves_nothing) {
  NEED_RGW();
  auto store = open_ok(opts("dropped"));
  ASSERT_TRUE(store);
  {
    auto w = store->create("half");
    ASSERT_TRUE(w);
    const std::string part = bytes_of(6u << 20, 2);
    ASSERT_TRUE(w.value()->write(part.data(), part.size()));  // one part uploaded
  }
  EXPECT_FALSE(store->size_of("half").value().has_value());
  EXPECT_TRUE(store->list().value().empty());
}

TEST(s3_store, a_wrong_secret_key_is_refused_in_one_line_and_nothing_is_written) {
  NEED_RGW();
  auto good = open_ok(opts("secrets"));
  ASSERT_TRUE(good);
  auto bad = open_s3_store(opts("secrets", "p", "not-the-secret"));
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("HTTP 403 SignatureDoesNotMatch"), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("check AWS_SECRET_ACCESS_KEY"), std::string::npos) << bad.message();
  EXPECT_EQ(bad.message().find('\n'), std::string::npos);
  // A checkpoint store opened with it fails the same way, and writes nothing.
  ::setenv("AWS_ACCESS_KEY_ID", kAccess.c_str(), 1);
  ::setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret", 1);
  auto ck = checkpoint_store::open("s3://secrets/p", {}, default_fs_env(), rgw::endpoint);
  ASSERT_FALSE(ck);
  EXPECT_NE(ck.message().find("checkpoint store: S3 LIST s3://secrets/p failed: HTTP 403 SignatureDoesNotMatch"), std::string::npos) << ck.message();
  ::unsetenv("AWS_ACCESS_KEY_ID");
  ::unsetenv("AWS_SECRET_ACCESS_KEY");
  EXPECT_TRUE(good->list().value().empty());
  auto no_bucket = open_s3_store(opts("never-made"));
  ASSERT_FALSE(no_bucket);
  EXPECT_NE(no_bucket.message().find("NoSuchBucket"), std::string::npos) << no_bucket.message();
}

TEST(s3_store, checkpoints_commit_rotate_and_skip_a_corrupt_part_as_in_a_directory) {
  NEED_RGW();
  auto o = opts("ckpts", "run/a");
  ASSERT_TRUE(s3_create_bucket(o));
  auto objects = open_s3_store(o);
  ASSERT_TRUE(objects) << objects.message();
  auto store = checkpoint_store::over(std::shared_ptr<object_store>(std::move(objects.value())), {2, false, "", true});
  auto commit = [&](int64_t step, int world) {
    const std::string stream = bytes_of(7u << 20, static_cast<int>(step));
    pb::checkpoint_meta m;
    m.set_model("vit");
    m.set_step(step);
    m.set_generation(1);
    m.set_state_bytes(stream.size());
    for (int r = 0; r < world; ++r) {
      auto [a, b] = part_range(stream.size(), r, world);
      auto p = write_part(store.objects(), part_name(step, 1, r, world), a, stream.data() + a, b - a);
      EXPECT_TRUE(p) << p.message();
      *m.add_parts() = p.value();
    }
    auto done = store.commit(m);
    EXPECT_TRUE(done) << done.message();
    return stream;
  };
  commit(1, 2);
  const std::string s2 = commit(2, 3);
  const std::string s3 = commit(3, 1);
  EXPECT_EQ(store.list().size(), 2u) << "keep_last 2";
  auto names = store.objects().list().value();
  EXPECT_EQ(names.size(), 2u + 3u + 1u) << "two manifests and their parts";
  // Corrupt step 3's only part: step 2 is what resumes, read back whole.
  ASSERT_TRUE(store.objects().put(part_name(3, 1, 0, 1), bytes_of(7u << 20, 99)));
  std::vector<std::string> skipped;
  auto newest = store.newest_valid([&](const std::string& n, const std::string& why) { skipped.push_back(n + ": " + why); }, true);
  ASSERT_TRUE(newest && newest.value());
  EXPECT_EQ(newest.value()->step(), 2);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0], "s3://ckpts/run/a/ckpt-000000003.manifest: checksum mismatch in part 'ckpt-000000003.g1.r0-of-1.part'");
  std::string back(s2.size(), '\0');
  ASSERT_TRUE(store.read_stream(*newest.value(), [&](uint64_t at, const char* d, size_t n) {
    std::memcpy(back.data() + at, d, n);
    return status{};
  }));
  EXPECT_EQ(back, s2);
}

// The "done when" with S3: a 2-node job checkpoints to s3://, then a
// coordinator on a "fresh machine" (an empty run directory: nothing on its
// disk) with the same s3:// prefix resumes from the newest committed
// checkpoint on 3 nodes.
TEST(s3_store, a_job_checkpoints_to_s3_and_a_coordinator_with_an_empty_disk_resumes_on_another_world_size) {
  NEED_RGW();
  ASSERT_TRUE(s3_create_bucket(opts("jobs")));
  ::setenv("AWS_ACCESS_KEY_ID", kAccess.c_str(), 1);
  ::setenv("AWS_SECRET_ACCESS_KEY", kSecret.c_str(), 1);
  testing::temp_dir first, second;
  auto run = [&](const std::string& dir, int nodes, int steps, const std::string& key = "") {
    std::vector<std::string> a = {DTACTOR_BINARY, "local", "--nodes", std::to_string(nodes), "--run-dir", dir};
    if (!key.empty()) a.insert(a.end(), {"--key", key});
    for (const std::string& s : std::vector<std::string>{"model.dim=16", "model.layers=1", "model.heads=2", "model.mlp_ratio=2", "train.global_batch_size=32",
                                "train.warmup_steps=5", "eval.max_samples=500", "eval.every_steps=0", "checkpoint.every_steps=10",
                                "train.log_every_steps=5", "checkpoint.dir=s3://jobs/run7", "checkpoint.s3_endpoint=" + rgw::endpoint,
                                "train.max_steps=" + std::to_string(steps)}) {
      a.push_back("--set");
      a.push_back(s);
    }
    auto c = child_process::spawn(a, false, dir + "/local.log");
    if (!c) return -1;
    auto e = c->wait(240000);
    return e ? e->exit_code : -1;
  };
  ASSERT_EQ(run(first.path(), 2, 30), 0) << file_text(first.path() + "/local.log");
  auto j1 = read_journal(first.path() + "/journal.jsonl");
  auto saved = events<ev::checkpoint_saved>(j1);
  ASSERT_GE(saved.size(), 3u);
  EXPECT_EQ(saved.back().at("path"), "s3://jobs/run7/ckpt-000000030.manifest");
  EXPECT_EQ(saved.back().at("parts"), 2);
  EXPECT_FALSE(std::filesystem::exists(first.path() + "/checkpoints")) << "nothing on the local disk";

  // The fresh machine gets the job's key (the first run's, which `local`
  // made): the manifests are signed with it, and a key of its own would
  // refuse them (docs/security.md).
  ASSERT_EQ(run(second.path(), 3, 40, first.path() + "/job.key"), 0) << file_text(second.path() + "/local.log");
  auto j2 = read_journal(second.path() + "/journal.jsonl");
  auto restored = events<ev::checkpoint_restored>(j2);
  ASSERT_FALSE(restored.empty());
  EXPECT_EQ(restored[0].at("source"), "disk");
  EXPECT_EQ(restored[0].at("step"), 30);
  auto fin = events<ev::job_finished>(j2);
  ASSERT_EQ(fin.size(), 1u);
  EXPECT_EQ(fin[0].at("step"), 40);
  EXPECT_EQ(fin[0].at("world_size"), 3);
  ::unsetenv("AWS_ACCESS_KEY_ID");
  ::unsetenv("AWS_SECRET_ACCESS_KEY");
}

// A broken or hostile endpoint (tests/hostile_s3.py): no Ceph needed.
struct hostile_s3 {
  std::optional<child_process> proc;
  std::string endpoint;
  hostile_s3(const std::string& mode, const std::string& dir) {
    const std::string port_file = dir + "/port";
    auto p = child_process::spawn({"/usr/bin/python3.11", DTACTOR_SOURCE_DIR "/tests/hostile_s3.py", "--mode", mode, "--port-file", port_file});
    if (!p) return;
    proc.emplace(std::move(p.value()));
    int port = 0;
    while (port == 0 && proc->running()) {  // until it listens (it writes the file once bound)
      std::ifstream f(port_file);
      if (!(f >> port)) {
        port = 0;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    if (port) endpoint = "http://127.0.0.1:" + std::to_string(port);
  }
  ~hostile_s3() {
    if (proc) {
      proc->signal(SIGKILL);
      proc->wait();
    }
  }
};

s3_options hostile_opts(const std::string& endpoint) {
  s3_options o;
  o.bucket = "b";
  o.prefix = "p";
  o.endpoint = endpoint;
  o.credentials = {kAccess, kSecret, ""};
  o.part_bytes = 5ull << 20;
  o.attempts = 2;
  return o;
}

TEST(s3_store, a_server_that_repeats_its_continuation_token_is_refused_not_paged_forever) {
  testing::temp_dir d;
  hostile_s3 srv("repeat-token", d.path());
  ASSERT_FALSE(srv.endpoint.empty()) << "tests/hostile_s3.py did not start";
  auto s = open_s3_store(hostile_opts(srv.endpoint));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("repeated continuation token 'same-token'"), std::string::npos) << s.message();
  EXPECT_EQ(s.message().find('\n'), std::string::npos) << "one line: " << s.message();
}

TEST(s3_store, an_answer_longer_than_the_cap_is_refused_without_buffering_it) {
  testing::temp_dir d;
  hostile_s3 srv("huge", d.path());
  ASSERT_FALSE(srv.endpoint.empty()) << "tests/hostile_s3.py did not start";
  auto s = open_s3_store(hostile_opts(srv.endpoint));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("the answer is longer than 16 MiB; refused"), std::string::npos) << s.message();
  EXPECT_EQ(s.message().find('\n'), std::string::npos) << "one line: " << s.message();
}

// The job's leader lease as objects in S3 (storage/leader_lease.hpp): the
// epoch taken by a conditional write, which radosgw refuses for an object
// that exists. The standbys' clock is a fake one.
TEST(s3_lease, of_eight_standbys_exactly_one_takes_a_lapsed_lease_and_the_old_holder_is_deposed) {
  NEED_RGW();
  std::atomic<int64_t> offset_ms{0};
  lease_options o;
  o.ttl = std::chrono::milliseconds(2000);
  o.now = [&offset_ms] { return std::chrono::steady_clock::time_point(std::chrono::milliseconds(offset_ms.load())); };
  auto open = [&]() {
    auto l = open_store_lease(open_ok(opts("leases", "job")), o);
    EXPECT_TRUE(l.ok()) << l.message();
    return l.ok() ? std::move(l.value()) : nullptr;
  };
  auto holder = open();
  ASSERT_TRUE(holder);
  auto mine = holder->try_acquire({0, "coord-a", "tcp://10.0.0.1:29500"});
  ASSERT_TRUE(mine.ok()) << mine.message();
  ASSERT_TRUE(mine->taken);
  EXPECT_EQ(mine->current.epoch, 1u);
  std::vector<std::unique_ptr<leader_lease>> standbys;
  for (int i = 0; i < 8; ++i) {
    standbys.push_back(open());
    ASSERT_TRUE(standbys.back());
    auto c = standbys.back()->try_acquire({0, "s" + std::to_string(i), ""});
    ASSERT_TRUE(c.ok()) << c.message();
    EXPECT_FALSE(c->taken);
    EXPECT_EQ(c->current.holder, "coord-a");
  }
  // Renewed within the TTL: held still.
  offset_ms += 1500;
  ASSERT_EQ(holder->renew().value(), renewal::renewed);
  offset_ms += 1500;
  EXPECT_FALSE(standbys[0]->try_acquire({0, "s0", ""})->taken);
  for (size_t i = 1; i < standbys.size(); ++i) EXPECT_FALSE(standbys[i]->try_acquire({0, "s" + std::to_string(i), ""})->taken);
  // Silent for the TTL: the standbys race, and one wins epoch 2.
  offset_ms += 2000;
  std::vector<int> won(standbys.size(), 0);
  std::vector<std::thread> ts;
  for (size_t i = 0; i < standbys.size(); ++i)
    ts.emplace_back([&, i] {
      auto c = standbys[i]->try_acquire({0, "s" + std::to_string(i), ""});
      won[i] = c.ok() && c->taken ? 1 : 0;
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(std::count(won.begin(), won.end(), 1), 1);
  auto now_held = holder->current();
  ASSERT_TRUE(now_held.ok()) << now_held.message();
  EXPECT_EQ(now_held->epoch, 2u);
  auto r = holder->renew();
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(*r, renewal::deposed);
  // Released: the next standby takes it at once.
  const size_t winner = static_cast<size_t>(std::find(won.begin(), won.end(), 1) - won.begin());
  ASSERT_LT(winner, standbys.size());
  ASSERT_TRUE(standbys[winner]->release().ok());
  const size_t next = (winner + 1) % standbys.size();
  auto after = standbys[next]->try_acquire({0, "s" + std::to_string(next), ""});
  ASSERT_TRUE(after.ok()) << after.message();
  EXPECT_TRUE(after->taken);
  EXPECT_EQ(after->current.epoch, 3u);
}

// A coordinator and its standby sharing the job's lease in S3: kill -9 of
// the leader, and the standby takes epoch 2 on the same address and run
// directory, adopts the running generation and ends the job without loss.
TEST(s3_lease, a_standby_coordinator_takes_over_a_lease_in_s3_and_the_job_finishes_without_loss) {
  NEED_RGW();
  ASSERT_TRUE(s3_create_bucket(opts("leases")));
  ::setenv("AWS_ACCESS_KEY_ID", kAccess.c_str(), 1);
  ::setenv("AWS_SECRET_ACCESS_KEY", kSecret.c_str(), 1);
  testing::temp_dir d;
  testing::cluster cl(d.path(), testing::job_sets(1500, {"cluster.min_nodes=2", "checkpoint.s3_endpoint=" + rgw::endpoint}));
  const std::vector<std::string> leased = {"--lease", "s3://leases/job9", "--lease-ttl-ms", "1000", "--standby"};
  ASSERT_EQ(cl.start_coordinator(leased), "");
  ASSERT_EQ(cl.start_node("a"), "");
  ASSERT_EQ(cl.start_node("b"), "");
  ASSERT_TRUE(cl.wait_step(30)) << cl.logs();
  std::vector<std::string> args = {DTACTOR_BINARY, "--role", "coordinator", "--listen", cl.endpoint, "--run-dir", cl.run_dir};
  args.insert(args.end(), cl.sets.begin(), cl.sets.end());
  args.insert(args.end(), leased.begin(), leased.end());
  const std::string standby_log = cl.run_dir + "/standby.log";
  auto standby = child_process::spawn(args, false, standby_log);
  ASSERT_TRUE(standby) << standby.message();
  // Until its log says `text`, or it ended, or 60 s.
  auto says = [&](const std::string& text) {
    for (int i = 0; i < 3000; ++i) {
      if (file_text(standby_log).find(text) != std::string::npos) return true;
      if (!standby->running()) break;
      standby->wait(20);
    }
    return file_text(standby_log).find(text) != std::string::npos;
  };
  ASSERT_TRUE(says("standing by: the job's lease is held by")) << file_text(standby_log);
  cl.coord->signal(SIGKILL);
  ASSERT_TRUE(cl.coord->wait(10000));
  ASSERT_TRUE(says("holds the job's lease at s3://leases/job9, epoch 2")) << file_text(standby_log);
  cl.coord.emplace(std::move(standby.value()));
  testing::expect_finished_without_loss(cl, 1500, 2);
  ::unsetenv("AWS_ACCESS_KEY_ID");
  ::unsetenv("AWS_SECRET_ACCESS_KEY");
}

TEST(s3_lease, a_server_that_ignores_conditional_writes_is_refused_in_one_line) {
  testing::temp_dir d;
  hostile_s3 srv("unconditional", d.path());
  ASSERT_FALSE(srv.endpoint.empty()) << "tests/hostile_s3.py did not start";
  auto store = open_s3_store(hostile_opts(srv.endpoint));
  ASSERT_TRUE(store.ok()) << store.message();
  auto l = open_store_lease(std::move(store.value()), lease_options{});
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.message().find("does not honour conditional writes (If-None-Match: *)"), std::string::npos) << l.message();
  EXPECT_EQ(l.message().find('\n'), std::string::npos) << "one line: " << l.message();
}

}  // namespace
}  // namespace dtactor

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::AddGlobalTestEnvironment(new dtactor::testing::rgw);
  return dtactor::testing::exit_status_with_skips(RUN_ALL_TESTS());
}
