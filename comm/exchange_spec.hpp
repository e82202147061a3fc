#pragma once
// Which exchange moves a generation's gradient buckets, as typed settings:
// the transport (where the bytes go) and the codec (how float32 values
// look on a process group's wire). Parsed once from the config
// (exchange_spec_of); make_exchange (exchange.hpp) builds the exchange, the
// codec taken from the registry (exchange_registry.hpp). No LibTorch here.
#include <cstdint>
#include <string>

#include "dtactor/config.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

enum class exchange_transport : uint8_t {
  process_group,  // the world's group (Gloo or NCCL) carries every bucket
  shared_memory,  // every rank on one host: the buckets summed in the world's segment
  hierarchical,   // shared memory within a host, a group of one leader per host across
  host,           // this host's ranks alone, through its segment, no group (train.diloco_worker = host)
};

// How float32 buckets cross a process group (cluster.wire_dtype). fp32 is
// exact (the group sums them: allreduce); the others are codecs in the
// registry. An open set: a codec registered elsewhere (a test) takes a
// value past the built-ins (register_codec).
enum class wire_codec : uint8_t { fp32, bf16, int8, int4 };

struct exchange_spec {
  exchange_transport transport = exchange_transport::process_group;
  wire_codec codec = wire_codec::fp32;
};

// cluster.wire_dtype (a registered codec's name) and
// cluster.shm_allreduce: shared_memory when the ranks may share memory
// (what a generation's hosts allow decides the rest: exchange.hpp's
// transport_for), else process_group. An error names an unknown codec.
result<exchange_spec> exchange_spec_of(const config& cfg);
// A registered codec by its name ("bf16"); an error lists the known ones.
result<wire_codec> codec_named(const std::string& name);
// Its registered name ("codec 200" for one nobody registered).
std::string name_of(wire_codec c);

}  // namespace dtactor
