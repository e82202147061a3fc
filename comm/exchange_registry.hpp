#pragma once
// The registry of wire codecs: cluster.wire_dtype's values, each a name, a
// factory and the shape of its process-group exchange (the shape of PyTorch
// DDP's comm hooks, whose compression wrappers compose with any hook). A
// codec wraps every transport that crosses a process group: the world's
// group, the hierarchical exchange's group of host leaders, ZeRO-2's
// reduce-scatter; shared memory sums in fp32 and needs none.
//
// A new codec is one class (bucket_codec) and one registration: the
// built-ins in exchange_registry.cpp's list, a test's from the test
// (tests/exchange_registry_test.cpp). Naming it in the config also takes
// its name in cluster.wire_dtype's allowed values (base/config.cpp).
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/exchange_spec.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

// Float32 values as bytes on a process group's wire: the encode before the
// transport, the decode after. One object per exchange, used on the
// training thread only (it may keep scratch between calls).
class bucket_codec {
 public:
  virtual ~bucket_codec() = default;
  // Bytes of the message of n values: a multiple of 4 (fp32 control words
  // follow it).
  virtual int64_t bytes(int64_t n) const = 0;
  // `values` (float32, contiguous) into `out` (kChar, bytes(values.numel())).
  virtual void encode(const torch::Tensor& values, const torch::Tensor& out) = 0;
  // The sum.numel() values of `in` (kChar, bytes(sum.numel())) added into
  // `sum` (float32), or copied into it when !add. Every rank decodes the
  // same bytes alike: the sums are bit-identical everywhere.
  virtual void decode(const torch::Tensor& in, const torch::Tensor& sum, bool add) = 0;
};

struct codec_entry {
  std::string name;  // cluster.wire_dtype's value
  // Null: exact, the group sums the buckets itself (allreduce).
  std::function<std::unique_ptr<bucket_codec>()> make;
  // From this many ranks on, each rank sums one shard of every bucket and
  // the shards, encoded once more, are all-gathered (half a ring's bytes at
  // any size, for a 2-byte codec); below it (0: always) every rank's
  // encoded bucket is all-gathered and summed by every rank (fewer
  // roundings, more bytes from 3 ranks on).
  int scatter_from = 0;
};

// Adds a codec under `id`; an error when the id or the name is taken.
// Thread-safe; entries live as long as the process.
status register_codec(wire_codec id, codec_entry e);
// The entry of `id`, or null.
const codec_entry* find_codec(wire_codec id);
// The registered codecs' names, in id order.
std::vector<std::string> codec_names();

// The built-in codecs (one file each), for the registry's list.
codec_entry bf16_codec();
codec_entry quantized_codec(int bits);  // int8 or int4
// int8 / int4: values per scale (one fp32 scale per block of a message).
inline constexpr int64_t int8_block = 256;
inline constexpr int64_t int4_block = 64;

}  // namespace dtactor
