#pragma once
// A real S3 server that checks SigV4 signatures for the tests that need one:
// Debian's Ceph radosgw on a one-machine cluster (scripts/rgw/start-rgw.sh:
// one monitor, one memstore OSD, one gateway on loopback), started once per
// test program by the `rgw` environment. Without Ceph's packages every test
// that says NEED_RGW() is skipped, saying so (CI installs them:
// scripts/install-deps.sh). A child process a test spawns from the same
// program reuses its parent's gateway: DTACTOR_TEST_RGW_ENDPOINT.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "net/zmq_bridge.hpp"
#include "skip.hpp"
#include "storage/s3_store.hpp"

namespace dtactor::testing {

inline const std::string kAccess = "TESTACCESSKEY0000001";
inline const std::string kSecret = "testsecretkey0000000000000000000000000001";

// The gateway, for the whole program.
class rgw : public ::testing::Environment {
 public:
  static inline std::string endpoint, dir, why_not;
  void SetUp() override {
    if (const char* inherited = std::getenv("DTACTOR_TEST_RGW_ENDPOINT"); inherited && *inherited) {
      endpoint = inherited;
      return;
    }
    if (::access("/usr/bin/radosgw", X_OK) != 0 || ::access("/usr/bin/ceph-mon", X_OK) != 0 || ::access("/usr/bin/ceph-osd", X_OK) != 0) {
      why_not = "Ceph's radosgw, ceph-mon and ceph-osd are not installed (scripts/install-deps.sh installs them)";
      return;
    }
    // The monitor and its daemons bind MON_PORT, +1 and +10..+99
    // (start-rgw.sh): the gateway's port lies outside that block.
    auto port = pick_free_tcp_port();
    auto mon = pick_free_tcp_port();
    for (int tries = 0; port && mon && tries < 100 && mon.value() <= port.value() && port.value() < mon.value() + 100; ++tries) mon = pick_free_tcp_port();
    if (!port || !mon) {
      why_not = "no free port";
      return;
    }
    char tmpl[] = "/tmp/dtactor-rgw-XXXXXX";
    dir = ::mkdtemp(tmpl);
    const std::string env = "RGW_PORT=" + std::to_string(port.value()) + " MON_PORT=" + std::to_string(mon.value()) + " S3_ACCESS_KEY=" + kAccess +
                            " S3_SECRET_KEY=" + kSecret;
    const std::string cmd =
        env + " bash " + std::string(DTACTOR_SOURCE_DIR) + "/scripts/rgw/start-rgw.sh " + dir + "/ceph > " + dir + "/start.log 2>&1";
    if (std::system(cmd.c_str()) != 0) {
      std::ifstream f(dir + "/start.log");
      std::stringstream ss;
      ss << f.rdbuf();
      why_not = "start-rgw.sh failed:\n" + ss.str();
      return;
    }
    endpoint = "http://127.0.0.1:" + std::to_string(port.value());
  }
  void TearDown() override {
    if (!dir.empty()) {
      const std::string cmd = "bash " + std::string(DTACTOR_SOURCE_DIR) + "/scripts/rgw/stop-rgw.sh " + dir + "/ceph > /dev/null 2>&1; rm -rf " + dir;
      (void)std::system(cmd.c_str());
    }
  }
};

// Skips without a gateway, saying why; under CI=true fails instead (its
// start log included).
#define NEED_RGW()                                                                                   \
  do {                                                                                               \
    if (::dtactor::testing::rgw::endpoint.empty()) SKIP_OR_FAIL_IN_CI(::dtactor::testing::rgw::why_not); \
  } while (0)

inline s3_options opts(const std::string& bucket, const std::string& prefix = "p", const std::string& secret = kSecret) {
  s3_options o;
  o.bucket = bucket;
  o.prefix = prefix;
  o.endpoint = rgw::endpoint;
  o.credentials = {kAccess, secret, ""};
  o.part_bytes = 5ull << 20;
  return o;
}

inline std::unique_ptr<object_store> open_ok(const s3_options& o) {
  EXPECT_TRUE(s3_create_bucket(o).ok());
  auto s = open_s3_store(o);
  EXPECT_TRUE(s.ok()) << s.message();
  return s.ok() ? std::move(s.value()) : nullptr;
}

}  // namespace dtactor::testing
