#pragma once
// Which exchange moves a generation's gradient buckets, as typed settings:
// the transport (where the bytes go) and the codec (how float32 values
// look on a process group's wire). Made from the parsed cluster settings
// (exchange_spec_of); make_exchange (exchange.hpp) builds the exchange, the
// codec taken from the registry (exchange_registry.hpp). No LibTorch here.
#include <cstdint>
#include <string>

#include "dtactor/result.hpp"
#include "job/modes.hpp"
#include "job/settings.hpp"

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

// The built-in codec of cluster.wire_dtype (the same four: the enum is the
// config's, job/modes.hpp; the codec set is open to registrations).
wire_codec codec_of(wire_dtype d);
// cluster.wire_dtype's codec and cluster.shm_allreduce: shared_memory when
// the ranks may share memory (what a generation's hosts allow decides the
// rest: exchange.hpp's transport_for), else process_group.
exchange_spec exchange_spec_of(const cluster_settings& cluster);
// A registered codec by its name ("bf16"); an error lists the known ones.
result<wire_codec> codec_named(const std::string& name);
// Its registered name ("codec 200" for one nobody registered).
std::string name_of(wire_codec c);

}  // namespace dtactor
