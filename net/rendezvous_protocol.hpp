#pragma once
// The rendezvous store's wire format, shared by the server
// (net/rendezvous_store.cpp, torch-free) and the c10d client
// (comm/rendezvous_client.cpp). ZeroMQ multipart messages over TCP: a
// client's DEALER sends
//   [request id (8 bytes, little endian), op, args...]
// and the server's ROUTER answers
//   [request id, "ok" | "err", results...]  ("err": one frame, the reason).
// The request id lets a client drop the late answer to a request it gave up
// on (a get that timed out and is answered when the key arrives after all).
//
//   op      args                          results
//   set     key, value                    -
//   get     key, timeout_ms               value          (parked until key exists)
//   add     key, delta (decimal)          new value (decimal; stored as text, as TCPStore does)
//   cas     key, expected, desired        the value now stored (TCPStore's compareSet)
//   check   key...                        "1" | "0"
//   del     key                           "1" | "0"
//   num     -                             number of keys (decimal)
//   wait    timeout_ms, key...            -              (parked until every key exists)
//
// timeout_ms 0 parks for as long as the server's own limit allows.
#include <cstdint>
#include <cstring>
#include <string>

namespace dtactor::rendezvous_protocol {

constexpr std::size_t id_bytes = 8;
// Largest frame the server takes: a control frame, as on every other
// dtactor socket (net/wire.hpp, max_control_message_bytes; libzmq buffers
// a frame before the handshake authenticates its sender). Keys and values
// are addresses and small blobs (net/rendezvous_store.hpp, rendezvous_limits).
constexpr int64_t max_message_bytes = int64_t{2} << 20;

inline std::string encode_id(uint64_t id) {
  std::string s(id_bytes, '\0');
  for (std::size_t i = 0; i < id_bytes; ++i) s[i] = static_cast<char>((id >> (8 * i)) & 0xff);
  return s;
}

inline uint64_t decode_id(const void* data) {
  uint64_t id = 0;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < id_bytes; ++i) id |= static_cast<uint64_t>(p[i]) << (8 * i);
  return id;
}

}  // namespace dtactor::rendezvous_protocol
