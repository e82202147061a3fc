// Training-step throughput of each model (samples/s, median of several runs)
// as JSON, with the BLAS library LibTorch really calls.
//
//   build/bench/bench_train_step [--examples DIR] [--models vit,transformer,gpt]
//                                [--steps N] [--repeats K] [--threads T]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/grad_sync.hpp"
#include "model/trainer.hpp"
#include "base/blas_info.hpp"

using namespace dtactor;

namespace {

const char* example_for(const std::string& model) {
  if (model == "vit") return "vit_fashion_mnist.toml";
  if (model == "transformer") return "transformer_eng_ita.toml";
  return "gpt_gcide.toml";
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  std::string examples = "examples", models = "vit,transformer,gpt";
  int steps = 20, repeats = 5, threads = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--examples") examples = argv[i + 1];
    else if (a == "--models") models = argv[i + 1];
    else if (a == "--steps") steps = std::atoi(argv[i + 1]);
    else if (a == "--repeats") repeats = std::atoi(argv[i + 1]);
    else if (a == "--threads") threads = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "bench_train_step: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  const blas_info blas = describe_blas();
  nlohmann::json out = {{"benchmark", "train_step"}, {"blas_library", blas.library}, {"blas_config", blas.config},
                        {"is_openblas", blas.is_openblas}, {"steps_per_run", steps}, {"runs", repeats}};
  std::stringstream ms(models);
  std::string model;
  while (std::getline(ms, model, ',')) {
    auto cfg = config::load(examples + "/" + example_for(model), {"train.threads=" + std::to_string(threads)});
    if (!cfg) {
      std::fprintf(stderr, "bench_train_step: %s\n", cfg.message().c_str());
      return 1;
    }
    configure_threads(threads);
    auto st = training_state::create(cfg.value());
    if (!st) {
      std::fprintf(stderr, "bench_train_step: %s\n", st.message().c_str());
      return 1;
    }
    auto& s = *st.value();
    // The step `dtactor train` takes at world 1: through a reducer without a group.
    grad_sync local(s.the_task().module()->parameters(), c10::intrusive_ptr<c10d::ProcessGroup>());
    const auto ctx = step_context::every_step(0, 1, local);
    for (int i = 0; i < 3; ++i)  // warm-up: allocator, thread pools
      if (auto w = s.train_step(ctx); !w) {
        std::fprintf(stderr, "bench_train_step: %s\n", w.message().c_str());
        return 1;
      }
    std::vector<double> sps, update_ms;
    for (int r = 0; r < repeats; ++r) {
      // The update's share (clipping, optimizer step, zeroing) as the step times it.
      double update_s = 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < steps; ++i) {
        auto done = s.train_step(ctx);
        if (!done) {
          std::fprintf(stderr, "bench_train_step: %s\n", done.message().c_str());
          return 1;
        }
        update_s += done->update_s;
      }
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      sps.push_back(steps * static_cast<double>(s.settings().train.global_batch_size) / dt);
      update_ms.push_back(1000 * update_s / steps);
    }
    out["models"][model] = {{"samples_per_s_median", median(sps)},
                            {"samples_per_s_runs", sps},
                            {"update_ms_per_step_median", median(update_ms)},
                            {"global_batch_size", s.settings().train.global_batch_size},
                            {"parameters", s.parameter_count()},
                            {"compute_threads", threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency())},
                            {"intra_op_threads", at::get_num_threads()}};
  }
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
