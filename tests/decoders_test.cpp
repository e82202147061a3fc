// Decoders of bytes from outside the process: the inputs fuzzing found
// (fuzz/, docs/fuzzing.md), each a regression test that fails without its
// fix. Torch-free and quick to build.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <optional>
#include <set>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "job/journal_events.hpp"
#include "actors/liveness.hpp"
#include "dtactor/config.hpp"
#include "examples/custom_task/csv_rows.hpp"
#include "model/idx.hpp"
#include "monitoring/metrics.hpp"
#include "storage/checkpoint_store.hpp"
#include "base/job_key.hpp"
#include "net/rendezvous_protocol.hpp"
#include "net/rendezvous_store.hpp"
#include "storage/s3_store.hpp"
#include "net/zap_handler.hpp"
#include "tests/test_util.hpp"

namespace dtactor {
namespace {

// fuzz_checkpoint_manifest: a manifest whose store says it is 2^40 bytes (a
// sparse file planted in a shared checkpoint directory; an S3 server's
// Content-Length) made object_store::get allocate all of it: the coordinator
// died of std::bad_alloc at start instead of skipping the manifest.
TEST(Decoders, AManifestThatClaims2To40BytesIsRefusedWithoutAllocatingThem) {
  testing::temp_dir dir;
  const std::string path = dir.path() + "/" + manifest_name(7);
  {
    std::ofstream f(path, std::ios::binary);
    f << "DTACMAN2";
  }
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(1) << 40), 0) << "a sparse file of 2^40 bytes";
  auto objects = open_directory_store_readonly(dir.path());
  ASSERT_TRUE(objects) << objects.message();
  auto store = checkpoint_store::over(std::shared_ptr<object_store>(std::move(objects.value())), checkpoint_policy{});
  auto meta = store.read_manifest(manifest_name(7));
  ASSERT_FALSE(meta);
  EXPECT_NE(meta.message().find("1099511627776 bytes"), std::string::npos) << meta.message();
  std::vector<std::string> skipped;
  auto newest = store.newest_valid([&](const std::string& p, const std::string&) { skipped.push_back(p); }, true);
  ASSERT_TRUE(newest) << newest.message();
  EXPECT_FALSE(newest.value());
  EXPECT_EQ(skipped.size(), 1u);
}

// fuzz_s3_xml: ListMultipartUploads keys outside the store's prefix (a key
// shorter than the prefix threw std::out_of_range; others were taken as the
// store's), and keys of deeper "folders": a coordinator on s3://bucket
// aborted the uploads in flight of every other job in the bucket.
TEST(Decoders, S3UploadsOutsideThePrefixAreNotTheStores) {
  const std::string xml =
      "<ListMultipartUploadsResult><Upload><Key>ab</Key><UploadId>1</UploadId></Upload>"
      "<Upload><Key>other/ckpt-000000001.g1.r0-of-1.part</Key><UploadId>2</UploadId></Upload>"
      "<Upload><Key>run/ckpt-000000002.g1.r0-of-1.part</Key><UploadId>3</UploadId></Upload>"
      "<Upload><Key>run/sub/x</Key><UploadId>4</UploadId></Upload></ListMultipartUploadsResult>";
  auto ups = parse_multipart_uploads(xml, "run/");
  ASSERT_EQ(ups.size(), 1u);
  EXPECT_EQ(ups[0].name, "ckpt-000000002.g1.r0-of-1.part");
  EXPECT_EQ(ups[0].key, "run/ckpt-000000002.g1.r0-of-1.part");
  EXPECT_EQ(ups[0].upload_id, "3");
  // The bucket's root: another job's prefix is not ours either.
  auto root = parse_multipart_uploads(xml, "");
  ASSERT_EQ(root.size(), 1u);
  EXPECT_EQ(root[0].key, "ab");
}

// fuzz_custom_task_csv: a label of 7.8e89 (or inf, nan) was converted to
// int64_t before its range was checked: undefined behaviour, caught here by
// UBSan (this target is built with -fsanitize=undefined).
TEST(Decoders, ACsvLabelOutsideInt64IsRefusedBeforeItIsConverted) {
  for (const std::string label : {"777777777777777777777777777777777777777777777777777777777777777777777777777777777777777609", "inf", "-inf", "nan", "1e19",
                                  "-1e19", "2.5", "3"}) {
    std::istringstream in("x,y,label\n0.5,0.25," + label + "\n");
    auto rows = tabular::parse_csv(in, "t.csv", 3);
    ASSERT_FALSE(rows) << label;
    EXPECT_NE(rows.message().find("is not a class id below model.classes (3)"), std::string::npos) << rows.message();
  }
  std::istringstream in("0.5,0.25,2\n1,2,0\n");
  auto rows = tabular::parse_csv(in, "t.csv", 3);
  ASSERT_TRUE(rows) << rows.message();
  EXPECT_EQ(rows->labels, (std::vector<int64_t>{2, 0}));
}

// fuzz_journal_report: a journal line whose integer field holds 5.7e74 (or
// 2^40 in an int32_t field) was converted anyway: undefined behaviour, and
// `dtactor report` printed garbage. Refused now, naming the field.
TEST(Decoders, AJournalNumberItsFieldCannotHoldIsRefused) {
  for (const std::string bad : {R"("world_size":5.66667e74)", R"("world_size":1099511627776)", R"("world_size":-1099511627776)",
                                R"("generation":-1)", R"("generation":1e300)", R"("start_step":9.3e18)", R"("world_size":2.5)"}) {
    auto r = ev::parse_journal_line(R"({"event":"generation_started","t":1.7e9,)" + bad + "}");
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.message().find("field"), std::string::npos) << r.message();
  }
  auto ok = ev::parse_journal_line(R"({"event":"generation_started","t":1.7e9,"world_size":2147483647,"generation":1.8e19,"start_step":-9.2e18})");
  ASSERT_TRUE(ok) << ok.message();
  const auto& g = std::get<ev::generation_started>(ok->event);
  EXPECT_EQ(g.world_size, 2147483647);
  EXPECT_EQ(g.generation, 18000000000000000000ull);
  EXPECT_EQ(g.start_step, -9200000000000000000ll);
}

// fuzz_config_toml (its property on a crafted input; libFuzzer did not reach
// it in 2 minutes): cluster.heartbeat_timeout_ms = 9.3e15 passed the checks,
// and the failure detector's deadline (now + timeout, in nanoseconds)
// overflowed; nodes took such values from register_ack unchecked.
TEST(Decoders, ADurationBeyondAWeekIsRefused) {
  auto c = config::parse_toml("[cluster]\nheartbeat_timeout_ms = 9300000000000000\n", "job.toml");
  ASSERT_FALSE(c);
  EXPECT_EQ(c.message(), "job.toml:2: config key 'cluster.heartbeat_timeout_ms' must be at most 604800000 (a week), got 9300000000000000");
  config cfg;
  EXPECT_FALSE(cfg.set("cluster.spin_wait_us", "604800000001"));
  EXPECT_FALSE(cfg.set("cluster.settle_ms", "9223372036854775807"));
  ASSERT_TRUE(cfg.set("cluster.heartbeat_timeout_ms", "604800000"));
  const auto cluster = cluster_settings_of(cfg);
  ASSERT_TRUE(cluster) << cluster.message();
  const auto live = liveness_options_from(cluster.value());
  const auto now = std::chrono::steady_clock::time_point{} + std::chrono::hours(24 * 365 * 100);
  EXPECT_GT(lost_deadline(now, live), now);
}

// fuzz_rendezvous_request (its property on a crafted input): "add" of 1 to a
// key holding 2^63 - 1 overflowed a signed integer in the store's thread.
TEST(Decoders, ARendezvousAddThatOverflowsIsAnError) {
  rendezvous_table t(std::chrono::seconds(1));
  const auto now = std::chrono::steady_clock::now();
  const std::string id = rendezvous_protocol::encode_id(1);
  t.handle({"peer", id, "set", "k", "9223372036854775807"}, now);
  const auto r = t.handle({"peer", id, "add", "k", "1"}, now);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0], (rendezvous_table::message{"peer", id, "err", "adding 1 to key 'k' overflows"}));
  EXPECT_EQ(t.handle({"peer", id, "add", "m", "-9223372036854775807"}, now)[0][2], "ok");
  EXPECT_EQ(t.handle({"peer", id, "add", "m", "-2"}, now)[0][2], "err");
  EXPECT_EQ(t.handle({"peer", id, "get", "k", "0"}, now)[0][3], "9223372036854775807") << "the key keeps its value";
}

// fuzz_idx_pair: an IDX header of 2^22 images of 2^21 x 2^21 pixels: the
// product (int64_t) overflowed and wrapped to 0, matching an empty file, and
// the tensor would have been made from 2^64 bytes that are not there.
TEST(Decoders, AnIdxHeaderWhoseSizesOverflowIsRefused) {
  auto be = [](std::vector<uint8_t>& b, uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(v >> s));
  };
  std::vector<uint8_t> images, labels;
  for (uint32_t v : {0x803u, 1u << 22, 1u << 21, 1u << 21}) be(images, v);
  for (uint32_t v : {0x801u, 1u << 22}) be(labels, v);
  labels.resize(8 + (size_t{1} << 22), 0);
  auto r = check_idx_pair(images, "images.gz", labels, "labels.gz");
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("'images.gz' is truncated: header says 4194304 images of 2097152x2097152"), std::string::npos) << r.message();
  // A real shape still reads.
  images.clear();
  for (uint32_t v : {0x803u, 2u, 2u, 2u}) be(images, v);
  images.insert(images.end(), 8, 7);
  labels.assign({0, 0, 8, 1, 0, 0, 0, 2, 3, 4});
  auto ok = check_idx_pair(images, "images.gz", labels, "labels.gz");
  ASSERT_TRUE(ok) << ok.message();
  EXPECT_EQ(ok->images, 2);
}

// -- the decoders split from their sockets for fuzzing: what they answer ------

using rendezvous_message = rendezvous_table::message;
const std::string rid = rendezvous_protocol::encode_id(7);

TEST(Decoders, TheRendezvousTableAnswersEveryOperation) {
  rendezvous_table t(std::chrono::seconds(60));
  const auto now = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  auto ask = [&](std::vector<std::string> frames) {
    rendezvous_message m{"peer", rid};
    m.insert(m.end(), frames.begin(), frames.end());
    return t.handle(std::move(m), now);
  };
  using replies = std::vector<rendezvous_message>;
  EXPECT_EQ(ask({"set", "k", "v"}), (replies{{"peer", rid, "ok"}}));
  EXPECT_EQ(ask({"get", "k", "1000"}), (replies{{"peer", rid, "ok", "v"}}));
  EXPECT_EQ(ask({"add", "n", "5"}), (replies{{"peer", rid, "ok", "5"}}));
  EXPECT_EQ(ask({"add", "n", "-2"}), (replies{{"peer", rid, "ok", "3"}}));
  EXPECT_EQ(ask({"add", "k", "1"}), (replies{{"peer", rid, "err", "key 'k' does not hold a number"}}));
  EXPECT_EQ(ask({"cas", "c", "", "x"}), (replies{{"peer", rid, "ok", "x"}}));
  EXPECT_EQ(ask({"cas", "c", "y", "z"}), (replies{{"peer", rid, "ok", "x"}}));
  EXPECT_EQ(ask({"check", "k", "c"}), (replies{{"peer", rid, "ok", "1"}}));
  EXPECT_EQ(ask({"check", "k", "nope"}), (replies{{"peer", rid, "ok", "0"}}));
  EXPECT_EQ(ask({"num"}), (replies{{"peer", rid, "ok", "3"}}));
  EXPECT_EQ(ask({"del", "c"}), (replies{{"peer", rid, "ok", "1"}}));
  EXPECT_EQ(ask({"wait", "0"}), (replies{{"peer", rid, "ok"}}));
  // Parked until the key comes, or the deadline.
  EXPECT_TRUE(ask({"get", "later", "500"}).empty());
  EXPECT_TRUE(ask({"wait", "0", "later", "k"}).empty());
  EXPECT_EQ(t.parked(), 2u);
  EXPECT_TRUE(t.release(now).empty());
  ask({"set", "later", "L"});
  EXPECT_EQ(t.release(now), (replies{{"peer", rid, "ok", "L"}, {"peer", rid, "ok"}}));
  EXPECT_TRUE(ask({"get", "never", "500"}).empty());
  EXPECT_TRUE(t.release(now + std::chrono::milliseconds(499)).empty());
  const auto timed_out = t.release(now + std::chrono::milliseconds(500));
  ASSERT_EQ(timed_out.size(), 1u);
  EXPECT_EQ(timed_out[0][2], "err");
  EXPECT_EQ(t.parked(), 0u);
  // Malformed: counted, never answered.
  for (const auto& bad : std::vector<rendezvous_message>{{"peer"}, {"peer", "short", "num"}, {"peer", rid, "bogus"}, {"peer", rid, "get", "k", "-5"}}) {
    std::string why;
    EXPECT_TRUE(t.handle(bad, now, &why).empty());
    EXPECT_FALSE(why.empty());
  }
  EXPECT_EQ(t.malformed(), 4u);
}

TEST(Decoders, TheStoreAnswersItsKeyHoldersAndNoOneElseOverSockets) {
  auto key = generate_job_key();
  auto other = generate_job_key();
  ASSERT_TRUE(key && other);
  auto shared = std::make_shared<const job_key>(key.value());
  auto store = rendezvous_store::start(0, std::chrono::seconds(5), shared);
  ASSERT_TRUE(store) << store.message();
  const std::string ep = "tcp://127.0.0.1:" + std::to_string(store.value()->port());
  zmq::context_t ctx;
  auto ask = [&](const job_key& k, const std::vector<std::string>& frames) -> std::optional<std::vector<std::string>> {
    zmq::socket_t s(ctx, zmq::socket_type::dealer);
    s.set(zmq::sockopt::linger, 0);
    make_curve_client(s, key->server_public, k.client_public, k.client_secret);
    s.connect(ep);
    zmq::multipart_t m;
    m.addstr(rid);
    for (const auto& f : frames) m.addstr(f);
    m.send(s);
    zmq::pollitem_t item{static_cast<void*>(s), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(2000)) <= 0) return std::nullopt;
    zmq::multipart_t reply;
    if (!reply.recv(s)) return std::nullopt;
    std::vector<std::string> out;
    while (!reply.empty()) out.push_back(reply.popstr());
    return out;
  };
  EXPECT_EQ(ask(key.value(), {"set", "k", "v"}), (std::vector<std::string>{rid, "ok"}));
  EXPECT_EQ(ask(key.value(), {"get", "k", "1000"}), (std::vector<std::string>{rid, "ok", "v"}));
  EXPECT_EQ(ask(other.value(), {"get", "k", "1000"}), std::nullopt) << "another job's client key is refused by the ZAP handler";
  EXPECT_GE(store.value()->refused_handshakes(), 1u);
}

TEST(Decoders, TheZapHandlerAdmitsOnlyCurveClientsOnItsList) {
  const std::set<std::string> allowed{std::string(32, 'k')};
  const std::vector<std::string> ok{"1.0", "id-1", "dtactor", "127.0.0.1", "", "CURVE", std::string(32, 'k')};
  auto d = decide_zap_request(ok, allowed);
  EXPECT_TRUE(d.admitted);
  EXPECT_EQ(d.reply, (std::vector<std::string>{"1.0", "id-1", "200", "OK", "", ""}));
  auto other = ok;
  other[6] = std::string(32, 'x');
  EXPECT_FALSE(decide_zap_request(other, allowed).admitted);
  auto null_mech = ok;
  null_mech[5] = "NULL";
  EXPECT_FALSE(decide_zap_request(null_mech, allowed).admitted);
  auto old = ok;
  old[0] = "0.9";
  EXPECT_FALSE(decide_zap_request(old, allowed).admitted);
  auto cut = decide_zap_request({"1.0", "id-2"}, allowed);
  EXPECT_FALSE(cut.admitted);
  EXPECT_EQ(cut.reply.size(), 6u);
  EXPECT_EQ(cut.reply[2], "400");
}

TEST(Decoders, KeyFilesParseAndAHugeOneIsNotRead) {
  auto key = generate_job_key();
  ASSERT_TRUE(key);
  testing::temp_dir dir;
  const std::string path = dir.path() + "/job.key";
  ASSERT_TRUE(write_job_key(path, key.value()));
  auto back = load_job_key(path);
  ASSERT_TRUE(back) << back.message();
  EXPECT_EQ(back->client_public, key->client_public);
  EXPECT_EQ(back->mac_key, key->mac_key);
  EXPECT_FALSE(parse_job_key("server_public = x\n", "k"));
  EXPECT_NE(parse_job_key("no equals sign\n", "k").message().find("line 1"), std::string::npos);
  // A 2^40-byte (sparse) file with the right mode: refused by its size.
  const std::string huge = dir.path() + "/huge.key";
  { std::ofstream(huge) << "server_public = "; }
  ASSERT_EQ(::chmod(huge.c_str(), 0600), 0);
  ASSERT_EQ(::truncate(huge.c_str(), static_cast<off_t>(1) << 40), 0);
  auto refused = load_job_key(huge);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.message().find("too long"), std::string::npos) << refused.message();
}

TEST(Decoders, S3ResponsesAsTheStoreReadsThem) {
  const auto page = parse_list_objects(
      "<ListBucketResult><IsTruncated>true</IsTruncated><NextContinuationToken>t&amp;1</NextContinuationToken>"
      "<Contents><Key>run/a.manifest</Key><Size>12</Size></Contents><Contents><Key>run/sub/b</Key><Size>1</Size></Contents>"
      "<Contents><Key>other/c</Key><Size>2</Size></Contents></ListBucketResult>",
      "run/");
  ASSERT_EQ(page.objects.size(), 1u);
  EXPECT_EQ(page.objects[0].name, "a.manifest");
  EXPECT_EQ(page.objects[0].size, 12u);
  EXPECT_TRUE(page.truncated);
  EXPECT_EQ(page.next_token, "t&1");
  const auto e = parse_s3_error("<Error><Code>NoSuchKey</Code><Message>The key &lt;x&gt; does not exist</Message></Error>");
  EXPECT_EQ(e.code, "NoSuchKey");
  EXPECT_EQ(e.message, "The key <x> does not exist");
  EXPECT_EQ(parse_upload_id("<InitiateMultipartUploadResult><UploadId>2~abc</UploadId></InitiateMultipartUploadResult>"), "2~abc");
}

TEST(Decoders, TheMetricsEndpointRoutesEveryRequest) {
  metrics m("job");
  m.add_route("/sd", "application/json", [] { return std::string("[]\n"); });
  const auto scrape = m.respond("GET", "/metrics");
  EXPECT_EQ(scrape.status, 200);
  EXPECT_NE(scrape.body.find("dtactor_"), std::string::npos);
  const auto sd = m.respond("GET", "/sd");
  EXPECT_EQ(sd.status, 200);
  EXPECT_EQ(sd.content_type, "application/json");
  EXPECT_EQ(sd.body, "[]\n");
  EXPECT_EQ(m.respond("POST", "/metrics").status, 405);
  EXPECT_EQ(m.respond("GET", "/nope").status, 404);
  EXPECT_EQ(m.respond(std::string("\0\xff", 2), "/metrics").status, 405);
}

}  // namespace
}  // namespace dtactor
