#pragma once
// Which BLAS the process really calls (LibTorch uses whatever libblas.so.3
// resolves to) and control of its thread count.
#include <string>

namespace dtactor {

struct blas_info {
  std::string library;  // file that provides sgemm_, e.g. .../openblas-pthread/libblas.so.3
  std::string config;   // OpenBLAS's own description, empty for other BLAS
  bool is_openblas = false;
};

blas_info describe_blas();

// Sets OpenBLAS's thread count when OpenBLAS is loaded; returns whether it was.
bool set_blas_threads(int n);

// OpenBLAS's idle worker threads spin for 2^28 cycles (~0.1 s) after every
// call before they sleep. Between two matrix products LibTorch works on one
// thread, so on a small machine the spinning workers take the cores it
// needs: `dtactor train` with its default 2 threads ran at 858-2,155
// samples/s from run to run here. Unless the user set
// OPENBLAS_THREAD_TIMEOUT, this sets it (to kBlasThreadTimeout: idle workers
// sleep at once) for this process and every process it starts: OpenBLAS
// reads it when it loads, so in this process its worker threads are shut
// down and start again with the new setting at the next call. Returns the
// value in force ("" without OpenBLAS). Call first thing in main.
std::string quiet_blas_workers();
constexpr int kBlasThreadTimeout = 4;

// OpenBLAS (built DYNAMIC_ARCH, as Debian's) picks its kernels from the
// CPU's model number; on a CPU it does not know (a VM reporting a generic
// "Intel(R) Xeon(R) Processor", as this project's machine does at times) it
// falls back to its Prescott kernels (SSE3): the ViT trained at 800
// samples/s instead of 1,830 with the AVX-512 kernels the CPU has. The
// kernels to use instead, from the CPU's features: "SkylakeX" (AVX-512
// F, BW, VL, DQ), "Haswell" (AVX2 and FMA), or "" (keep OpenBLAS's choice,
// which is only overridden when it is one of the old fallbacks). Pure.
std::string better_blas_core(const std::string& openblas_core, bool avx2_fma, bool avx512);

// OpenBLAS's kernel name in this process (openblas_get_corename), "" without OpenBLAS.
std::string blas_core();

// Call first thing in main. When this process's OpenBLAS fell back to old
// kernels on a newer CPU and OPENBLAS_CORETYPE is unset, sets it (to
// better_blas_core's choice) and executes this program again, with the same
// arguments and process id (OpenBLAS reads it only when it loads); the
// processes it starts inherit it. Says so in one line when `say`. Returns
// only when it did nothing (or the exec failed).
void use_the_cpus_blas_kernels(char** argv, bool say);

// The same choice for the processes this one starts, in a process that has
// no OpenBLAS loaded (the torch-free `dtactor`: a node agent before its
// ranks, `local` before its nodes, the launcher of `dtactor-train`): loads
// libblas.so.3 once to ask which kernels OpenBLAS picks here, and sets
// OPENBLAS_CORETYPE when they are a fallback, so that no training process
// has to load LibTorch twice (a replacement rank's start counts).
void choose_blas_kernels_for_children();

}  // namespace dtactor
