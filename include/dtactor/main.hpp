#pragma once
// dtactor's public C++ API, part 2 of 2: the whole dtactor command line in
// your own program. After registering your tasks (dtactor/task.hpp), hand
// main's arguments to run_main: the program then is a dtactor binary with
// every mode (train, eval, export, config, report, local) and the cluster
// roles (--role coordinator|node), and it starts its own rank processes as
// copies of itself (/proc/self/exe), so the ranks know your tasks too. Start
// every process of a job (coordinator and nodes) with the same program.
//
//   int main(int argc, char** argv) {
//     if (auto st = dtactor::register_task(my_registration()); !st) { ...; return 2; }
//     return dtactor::run_main(argc, argv);
//   }
//
// Returns the exit code: 0 done, 1 the job failed, 2 bad command line or
// config, 128+N stopped by signal N (after a checkpoint). Call it once.
namespace dtactor {

int run_main(int argc, char** argv);

}  // namespace dtactor
