#include "monitoring/gpu_metrics.hpp"

#include <dlfcn.h>

#include <vector>

#include <prometheus/gauge.h>

namespace dtactor {

namespace {

// The few NVML entry points used, with their C signatures (nvml.h).
using nvml_return = int;  // NVML_SUCCESS = 0
using nvml_device = void*;
struct nvml_memory {
  unsigned long long total, free, used;
};
// nvmlMemory_v2_t (NVML 11.5 on): `used` without the driver's reserved
// memory, the figure nvidia-smi shows. v1's `used` counts the reservation
// (seen on an H200 with driver 580: 615 MiB "used" by an idle GPU that
// nvidia-smi reports as 0 MiB).
struct nvml_memory_v2 {
  unsigned int version;
  unsigned long long total, reserved, free, used;
};
constexpr unsigned int nvml_memory_v2_version = static_cast<unsigned int>(sizeof(nvml_memory_v2)) | (2u << 24);
struct nvml_utilization {
  unsigned int gpu, memory;  // percent
};
using init_fn = nvml_return (*)();
using count_fn = nvml_return (*)(unsigned int*);
using handle_fn = nvml_return (*)(unsigned int, nvml_device*);
using memory_fn = nvml_return (*)(nvml_device, nvml_memory*);
using memory_v2_fn = nvml_return (*)(nvml_device, nvml_memory_v2*);
using util_fn = nvml_return (*)(nvml_device, nvml_utilization*);
using shutdown_fn = nvml_return (*)();

}  // namespace

struct gpu_metrics::impl {
  void* lib = nullptr;
  memory_fn memory = nullptr;
  memory_v2_fn memory_v2 = nullptr;  // absent before NVML 11.5
  util_fn utilization = nullptr;
  shutdown_fn shutdown = nullptr;
  std::vector<nvml_device> handles;
  std::vector<prometheus::Gauge*> used, total, util;
};

gpu_metrics::gpu_metrics(prometheus::Registry& registry, const std::string& library) : impl_(std::make_unique<impl>()) {
  auto& im = *impl_;
  im.lib = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!im.lib) {
    why_not_ = "no NVML (" + library + " not found): no GPU metrics";
    return;
  }
  auto sym = [&](const char* name) { return ::dlsym(im.lib, name); };
  auto init = reinterpret_cast<init_fn>(sym("nvmlInit_v2"));
  auto count = reinterpret_cast<count_fn>(sym("nvmlDeviceGetCount_v2"));
  auto handle = reinterpret_cast<handle_fn>(sym("nvmlDeviceGetHandleByIndex_v2"));
  im.memory = reinterpret_cast<memory_fn>(sym("nvmlDeviceGetMemoryInfo"));
  im.memory_v2 = reinterpret_cast<memory_v2_fn>(sym("nvmlDeviceGetMemoryInfo_v2"));
  im.utilization = reinterpret_cast<util_fn>(sym("nvmlDeviceGetUtilizationRates"));
  im.shutdown = reinterpret_cast<shutdown_fn>(sym("nvmlShutdown"));
  unsigned int n = 0;
  if (!init || !count || !handle || !im.memory || !im.utilization || !im.shutdown) {
    why_not_ = library + " lacks the NVML functions dtactor needs: no GPU metrics";
    return;
  }
  if (init() != 0) {
    why_not_ = "nvmlInit failed (no driver loaded?): no GPU metrics";
    im.shutdown = nullptr;
    return;
  }
  if (count(&n) != 0) n = 0;
  auto& used = prometheus::BuildGauge().Name("dtactor_gpu_memory_used_bytes").Help("GPU memory in use (without the driver's reservation, as nvidia-smi shows it), from NVML").Register(registry);
  auto& total = prometheus::BuildGauge().Name("dtactor_gpu_memory_total_bytes").Help("GPU memory, from NVML").Register(registry);
  auto& util = prometheus::BuildGauge()
                   .Name("dtactor_gpu_utilization_ratio")
                   .Help("Fraction of NVML's last sample period in which a kernel ran")
                   .Register(registry);
  for (unsigned int i = 0; i < n; ++i) {
    nvml_device h = nullptr;
    if (handle(i, &h) != 0) continue;
    const std::map<std::string, std::string> l = {{"gpu", std::to_string(i)}};
    im.handles.push_back(h);
    im.used.push_back(&used.Add(l));
    im.total.push_back(&total.Add(l));
    im.util.push_back(&util.Add(l));
  }
  devices_ = static_cast<int>(im.handles.size());
  available_ = true;
  sample();
}

gpu_metrics::~gpu_metrics() {
  if (impl_->shutdown) impl_->shutdown();
  if (impl_->lib) ::dlclose(impl_->lib);
}

void gpu_metrics::sample() {
  if (!available_) return;
  auto& im = *impl_;
  for (size_t i = 0; i < im.handles.size(); ++i) {
    nvml_memory_v2 m2{};
    m2.version = nvml_memory_v2_version;
    nvml_memory m{};
    if (im.memory_v2 && im.memory_v2(im.handles[i], &m2) == 0) {
      im.used[i]->Set(static_cast<double>(m2.used));
      im.total[i]->Set(static_cast<double>(m2.total));
    } else if (im.memory(im.handles[i], &m) == 0) {
      im.used[i]->Set(static_cast<double>(m.used));
      im.total[i]->Set(static_cast<double>(m.total));
    }
    nvml_utilization u{};
    if (im.utilization(im.handles[i], &u) == 0) im.util[i]->Set(u.gpu / 100.0);
  }
}

}  // namespace dtactor
