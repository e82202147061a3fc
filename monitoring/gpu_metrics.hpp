#pragma once
// GPU memory and utilisation per device through NVML, for a node's /metrics.
// NVML (libnvidia-ml.so.1, part of the NVIDIA driver) is loaded at run time
// with dlopen, so the binary needs no CUDA at build time and a machine
// without the driver simply has no GPU series. Series (label `gpu`: the
// device index, bounded by the devices present):
//   dtactor_gpu_memory_used_bytes, dtactor_gpu_memory_total_bytes,
//   dtactor_gpu_utilization_ratio (0..1, over NVML's last sample period).
#include <memory>
#include <string>

#include <prometheus/registry.h>

namespace dtactor {

class gpu_metrics {
 public:
  // Tries to load NVML from `library` (tests pass a path that does not exist).
  explicit gpu_metrics(prometheus::Registry& registry, const std::string& library = "libnvidia-ml.so.1");
  ~gpu_metrics();
  gpu_metrics(const gpu_metrics&) = delete;
  gpu_metrics& operator=(const gpu_metrics&) = delete;

  // Whether NVML loaded and initialised; otherwise why not (one line).
  bool available() const { return available_; }
  const std::string& why_not() const { return why_not_; }
  int devices() const { return devices_; }
  // Reads every device once; cheap (microseconds), call every few seconds.
  void sample();

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
  bool available_ = false;
  std::string why_not_;
  int devices_ = 0;
};

}  // namespace dtactor
