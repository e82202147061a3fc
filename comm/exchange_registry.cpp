// The codec registry, the exchange spec's parsing and the choice of a
// transport (make_exchange). See exchange_registry.hpp and exchange.hpp.
#include "comm/exchange_registry.hpp"

#include "comm/exchange.hpp"

#include <map>
#include <mutex>

namespace dtactor {

namespace {

struct registry {
  std::mutex mu;
  std::map<wire_codec, std::unique_ptr<const codec_entry>> entries;
};

// The built-in codecs: one line each. fp32 has no codec (the group sums).
registry& the_registry() {
  static registry* r = [] {
    auto* x = new registry;  // never destroyed: ranks' threads may look up during exit
    auto add = [x](wire_codec id, codec_entry e) { x->entries[id] = std::make_unique<const codec_entry>(std::move(e)); };
    add(wire_codec::fp32, codec_entry{"fp32", nullptr, 0});
    add(wire_codec::bf16, bf16_codec());
    add(wire_codec::int8, quantized_codec(8));
    add(wire_codec::int4, quantized_codec(4));
    return x;
  }();
  return *r;
}

}  // namespace

status register_codec(wire_codec id, codec_entry e) {
  auto& r = the_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.entries.count(id)) return make_error("codec " + std::to_string(static_cast<int>(id)) + " is registered already (" + r.entries[id]->name + ")");
  for (const auto& [other, entry] : r.entries)
    if (entry->name == e.name) return make_error("a codec named '" + e.name + "' is registered already");
  r.entries[id] = std::make_unique<const codec_entry>(std::move(e));
  return {};
}

const codec_entry* find_codec(wire_codec id) {
  auto& r = the_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.entries.find(id);
  return it == r.entries.end() ? nullptr : it->second.get();
}

std::vector<std::string> codec_names() {
  auto& r = the_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> out;
  for (const auto& [id, entry] : r.entries) out.push_back(entry->name);
  return out;
}

result<wire_codec> codec_named(const std::string& name) {
  auto& r = the_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::string known;
  for (const auto& [id, entry] : r.entries) {
    if (entry->name == name) return id;
    known += (known.empty() ? "" : ", ") + entry->name;
  }
  return make_error("cluster.wire_dtype = '" + name + "' is no codec dtactor has (" + known + ")");
}

std::string name_of(wire_codec c) {
  const auto* e = find_codec(c);
  return e ? e->name : "codec " + std::to_string(static_cast<int>(c));
}

wire_codec codec_of(wire_dtype d) {
  switch (d) {
    case wire_dtype::automatic:  // resolved by cluster_settings_of
    case wire_dtype::fp32:
      return wire_codec::fp32;
    case wire_dtype::bf16:
      return wire_codec::bf16;
    case wire_dtype::int8:
      return wire_codec::int8;
    case wire_dtype::int4:
      return wire_codec::int4;
  }
  return wire_codec::fp32;
}

exchange_spec exchange_spec_of(const cluster_settings& cluster) {
  exchange_spec s;
  s.codec = codec_of(cluster.wire);
  s.transport = cluster.shm_allreduce ? exchange_transport::shared_memory : exchange_transport::process_group;
  return s;
}

namespace {

// Shared memory reserves each bucket rounded to 16 floats in a ring: the
// flat exchange needs room for its largest bucket, the hierarchical one
// for a whole step and its largest bucket (wrapping wastes at most one).
// Float32 buckets only; no segment (a rank alone on its host) holds any.
bool fits_shm(const std::vector<exchange_bucket>& buckets, const shm_group* shm, bool whole_step) {
  int64_t total = 0, largest = 0;
  for (const auto& b : buckets) {
    if (b.flat.scalar_type() != torch::kFloat) return false;
    const int64_t rounded = (b.numel + 15) / 16 * 16;
    total += rounded;
    largest = std::max(largest, rounded);
  }
  return !shm || (whole_step ? total + largest : largest) <= shm->capacity();
}

// The world's process group carries the buckets (the codec on its wire).
result<std::unique_ptr<bucket_exchange>> over_group(std::vector<exchange_bucket>& buckets, wire_codec codec, const exchange_groups& g,
                                                    const exchange_waits& w) {
  if (!g.pg) return make_error("gradient exchange over the process group: there is no group");
  if (g.zero2) return make_zero_scatter_exchange(buckets, g.pg, codec, w);
  return make_wire_exchange(buckets, g.pg, codec, w);
}

// Every rank decides alike (same parameters, same capacity): either the
// whole world goes hierarchical or the whole world uses the group.
result<std::unique_ptr<bucket_exchange>> hierarchical(std::vector<exchange_bucket>& buckets, wire_codec codec, const exchange_groups& g,
                                                      const exchange_waits& w) {
  if (!fits_shm(buckets, g.shm.get(), true)) return over_group(buckets, codec, g, w);
  const bool leader = !g.shm || g.shm->rank() == 0;
  if (!leader) return make_hierarchical_exchange(buckets, g.shm, nullptr, w);
  const int rank = g.pg ? g.pg->getRank() : 0;
  if (!g.hosts)
    return make_error("hierarchical gradient exchange: rank " + std::to_string(rank) + " leads its host but has no group of hosts");
  auto across = make_wire_exchange(buckets, g.hosts, codec, w, "exchange across hosts");
  if (!across) return across.err();
  return make_hierarchical_exchange(buckets, g.shm, std::move(across.value()), w);
}

}  // namespace

result<std::unique_ptr<bucket_exchange>> make_exchange(std::vector<exchange_bucket>& buckets, const exchange_spec& spec, const exchange_groups& g,
                                                       const exchange_waits& w) {
  switch (spec.transport) {
    case exchange_transport::host:
      return host_exchange(buckets, g.shm, w);
    case exchange_transport::hierarchical:
      return hierarchical(buckets, spec.codec, g, w);
    case exchange_transport::shared_memory: {
      const int world = g.pg ? g.pg->getSize() : 1, rank = g.pg ? g.pg->getRank() : 0;
      if (g.shm && g.shm->world() == world && g.shm->rank() == rank && fits_shm(buckets, g.shm.get(), false))
        return make_shm_exchange(buckets, g.shm, w);
      return over_group(buckets, spec.codec, g, w);
    }
    case exchange_transport::process_group:
      if (g.shm) return make_error("gradient exchange over the process group was handed a shared-memory segment: say which transport uses it");
      return over_group(buckets, spec.codec, g, w);
  }
  return make_error("gradient exchange: transport " + std::to_string(static_cast<int>(spec.transport)) + " is none dtactor has");
}

exchange_transport transport_for(const exchange_spec& spec, const exchange_plan& plan) {
  if (spec.transport != exchange_transport::shared_memory) return spec.transport;
  if (plan.hierarchical) return exchange_transport::hierarchical;
  return plan.shm ? exchange_transport::shared_memory : exchange_transport::process_group;
}

}  // namespace dtactor
