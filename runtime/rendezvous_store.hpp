#pragma once
// The c10d TCPStore server the ranks of every generation meet at, behind a
// header without LibTorch (the coordinator holds one and never touches a
// tensor). Keys of different generations never collide: each generation's
// group uses its own prefix (runtime/communicator.hpp).
#include <chrono>
#include <memory>
#include <string>

#include "dtactor/result.hpp"

namespace dtactor {

class rendezvous_store {
 public:
  // Listens on every interface at `port`. `timeout`: how long a rank's get
  // may wait for a key (ranks of a generation may arrive seconds apart).
  static result<std::unique_ptr<rendezvous_store>> start(int port, std::chrono::milliseconds timeout);
  ~rendezvous_store();
  rendezvous_store(const rendezvous_store&) = delete;
  rendezvous_store& operator=(const rendezvous_store&) = delete;

 private:
  struct impl;
  explicit rendezvous_store(std::unique_ptr<impl> im);
  std::unique_ptr<impl> im_;
};

}  // namespace dtactor
