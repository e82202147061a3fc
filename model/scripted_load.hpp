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
// made), and its own shards of each unit's (torchscript_task's `initial`,
// at the job's first step).
//
// Refused (nullopt, the caller loads the module whole): a file with tensor
// constants in its code (they would be on the meta device), a class with
// __setstate__, a record that is compressed. A record outside the file is
// an error (a corrupt file), one line.
#include <torch/script.h>

#include <optional>
#include <string>

#include "dtactor/result.hpp"

namespace dtactor {

result<std::optional<torch::jit::Module>> load_mapped(const std::string& file);

}  // namespace dtactor
