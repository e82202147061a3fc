#pragma once
// dtactor's public C++ API (find_package(dtactor); target dtactor::dtactor).
// Everything a program of your own needs to train its model with dtactor:
//   dtactor/result.hpp  error, result<T>, status: failures as one clear line
//   dtactor/config.hpp  config (typed keys) and config_key (your own keys)
//   dtactor/task.hpp    task (model, data, loss, metrics), register_task
//   dtactor/main.hpp    run_main: the whole dtactor command line
//   dtactor/shards.hpp  shard_set: a data key's shards (glob, range, list,
//                       s3://) read through the node's cache; data_error
// No other header of dtactor is part of the API. See docs/cpp_api.md.
#include "dtactor/config.hpp"
#include "dtactor/main.hpp"
#include "dtactor/result.hpp"
#include "dtactor/shards.hpp"
#include "dtactor/task.hpp"
