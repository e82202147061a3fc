// The ZAP handler's requests (net/zap_handler.hpp, ZeroMQ RFC 27): with
// a job key, libzmq asks it about every CURVE handshake at a server socket
// (the coordinator's, a node's for its ranks, the rendezvous store's); the
// address and the client's public key come from the peer. Input: records,
// each one frame of a request. Properties: the reply always has the six
// frames RFC 27 wants and echoes the request id; a client is admitted only
// for version 1.0, mechanism CURVE and a key in the allow-list.
#include <set>

#include "fuzz/fuzz_util.hpp"
#include "net/zap_handler.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::set<std::string> allowed{std::string(32, '\x01'), std::string(32, 'k')};
  fuzz::reader in(data, size);
  std::vector<std::string> request;
  while (!in.empty() && request.size() < 64) {
    (void)in.u8();
    request.push_back(in.payload());
  }
  const auto d = decide_zap_request(request, allowed);
  if (d.reply.size() != 6 || d.reply[0] != "1.0") fuzz::fail("a ZAP reply that is not six frames of version 1.0");
  const bool well_formed = request.size() >= 6;
  if (well_formed && d.reply[1] != request[1]) fuzz::fail("the reply does not echo the request id");
  const bool should = well_formed && request[0] == "1.0" && request[5] == "CURVE" && request.size() >= 7 && allowed.count(request[6]) != 0;
  if (d.admitted != should) fuzz::fail("admitted a client it should not, or refused one it should admit");
  if (d.reply[2] != (d.admitted ? "200" : "400")) fuzz::fail("the status code does not say the decision");
  return 0;
}
