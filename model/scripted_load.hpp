#pragma once
// model.file loaded without reading its tensors' values (a rank building
// its model deferred: train.zero = 3, or bf16 masters sharded; see
// model/layers defer_block_values). torch::jit::load reads every tensor
// into fresh memory, so every rank would hold the whole model while it
// starts. Here the module's code is loaded with its tensors on the meta
// device (LibTorch reads one tensor at a time and drops it), and the
// module's data is unpickled again with every tensor a view of the file,
// mapped private and read only where touched (writes are copied, never
// written back). Buffers and other tensors but the trained parameters are
// copied out at once. The rank then reads from the file only what it
// needs: the parameters of no unit (its optimizer copies them in as it is
// made, right after the load), and its own units' (torchscript_task's
// `initial`, at the job's first step, through file_values: read with
// pread, never through the mapping, so a file truncated meanwhile is an
// error and not a SIGBUS).
//
// Refused (nullopt, the caller loads the module whole): a file with tensor
// constants in its code (they would be on the meta device), a class with
// __setstate__, a record that is compressed. A record outside the file is
// an error (a corrupt file), one line.
#include <torch/script.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtactor/result.hpp"

namespace dtactor {

result<std::optional<torch::jit::Module>> load_mapped(const std::string& file);

struct mapped_source;

// Where a tensor of a module load_mapped gave lies in its file, to read
// its values again later without the mapping: the file stays open (a file
// replaced by a rename is still the one loaded), and a read checks that
// its size and modification time are those of the load. A file changed or
// truncated since is one line of error, not values of two files mixed.
class file_values {
 public:
  // nullopt where t's storage is no view of a file load_mapped mapped.
  static std::optional<file_values> of(const torch::Tensor& t);
  // The values, in memory of their own, with t's sizes and strides.
  result<torch::Tensor> read() const;

 private:
  std::shared_ptr<const mapped_source> src_;
  int64_t offset_ = 0;  // the storage's first byte in the file
  int64_t nbytes_ = 0;
  c10::ScalarType dtype_ = c10::kFloat;
  std::vector<int64_t> sizes_, strides_;
  int64_t storage_offset_ = 0;
};

}  // namespace dtactor
