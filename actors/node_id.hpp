#pragma once
// A node's id: names one machine's node agent (--node-id, a pod's or Slurm
// node's name, else the host name; membership.hpp's node_id_problem says
// which texts are ids). A type of its own so that it is never mixed up with
// the strings beside it (a peer's routing id, an address, a reason); its
// text is what the wire and the journal carry.
#include <string>
#include <utility>

namespace dtactor {

class node_id {
 public:
  node_id() = default;
  explicit node_id(std::string text) : text_(std::move(text)) {}

  const std::string& str() const { return text_; }
  bool empty() const { return text_.empty(); }

  friend bool operator==(const node_id& a, const node_id& b) { return a.text_ == b.text_; }
  friend bool operator!=(const node_id& a, const node_id& b) { return a.text_ != b.text_; }
  friend bool operator<(const node_id& a, const node_id& b) { return a.text_ < b.text_; }

 private:
  std::string text_;
};

}  // namespace dtactor
