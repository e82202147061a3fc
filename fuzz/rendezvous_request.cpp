// The rendezvous store's requests (net/rendezvous_store.hpp,
// rendezvous_protocol.hpp): multipart messages from any client that reaches
// the coordinator's store port (with a job key, only from the job's own
// processes). Input: records, each one frame; tag % 4 == 1 means more
// frames follow, 0 ends the message (the client's routing id is its first
// frame, as a ROUTER receives it); 2 moves the clock by the payload's first
// two bytes in milliseconds and releases parked requests; 3 releases now.
// Properties: no request crashes the store; every reply is addressed to the
// request's peer and id and says ok or err; a parked request is answered or
// timed out by its deadline.
#include <chrono>

#include "fuzz/fuzz_util.hpp"
#include "net/rendezvous_store.hpp"

using namespace dtactor;

namespace {

void check(const std::vector<rendezvous_table::message>& replies) {
  for (const auto& r : replies)
    if (r.size() < 3 || r[1].size() != 8 || (r[2] != "ok" && r[2] != "err") || (r[2] == "err" && r.size() != 4))
      fuzz::fail("a reply that is not [peer, id, ok|err, ...]");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto timeout = std::chrono::milliseconds(60000);
  rendezvous_table table(timeout);
  auto now = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  rendezvous_table::message m;
  fuzz::for_each_record(data, size, [&](uint8_t tag, std::string payload) {
    switch (tag % 4) {
      case 0:
      case 1:
        m.push_back(std::move(payload));
        if (tag % 4 == 0) {
          const size_t parked = table.parked();
          auto replies = table.handle(std::move(m), now);
          check(replies);
          if (replies.size() > 1 || table.parked() > parked + 1) fuzz::fail("one request, several answers or parked requests");
          m.clear();
        }
        break;
      case 2: {
        const unsigned ms = payload.size() >= 2 ? static_cast<uint8_t>(payload[0]) | static_cast<uint8_t>(payload[1]) << 8 : 100;
        now += std::chrono::milliseconds(ms);
        check(table.release(now));
        break;
      }
      default:
        check(table.release(now));
        break;
    }
  });
  // Past every deadline nothing stays parked.
  check(table.release(now + timeout));
  if (table.parked() != 0) fuzz::fail("a parked request outlived its deadline");
  return 0;
}
