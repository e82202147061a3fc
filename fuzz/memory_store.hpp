#pragma once
// An object_store in memory, for the fuzz targets that read checkpoints
// (manifests, parts) without a disk or a server. size_of() may be told to
// claim another size than the bytes held, as a lying S3 server's
// Content-Length or a planted sparse file would.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "storage/object_store.hpp"

namespace dtactor::fuzz {

class memory_store : public object_store {
 public:
  std::map<std::string, std::string> objects;
  std::map<std::string, uint64_t> claimed_size;  // overrides size_of() (and list()) for a name

  const std::string& location() const override { return location_; }

  result<std::unique_ptr<object_writer>> create(const std::string& name) override {
    if (name.empty() || name.find('/') != std::string::npos) return make_error("bad object name '" + name + "'");
    return std::unique_ptr<object_writer>(std::make_unique<writer>(*this, name));
  }

  result<uint64_t> read(const std::string& name, uint64_t offset, void* dst, uint64_t size) override {
    auto it = objects.find(name);
    if (it == objects.end()) return make_error("no object '" + name + "'");
    if (offset >= it->second.size()) return uint64_t{0};
    const uint64_t n = std::min<uint64_t>(size, it->second.size() - offset);
    std::memcpy(dst, it->second.data() + offset, static_cast<size_t>(n));
    return n;
  }

  result<std::optional<uint64_t>> size_of(const std::string& name) override {
    if (auto c = claimed_size.find(name); c != claimed_size.end()) return std::optional<uint64_t>(c->second);
    auto it = objects.find(name);
    if (it == objects.end()) return std::optional<uint64_t>();
    return std::optional<uint64_t>(it->second.size());
  }

  result<std::vector<object_info>> list() override {
    std::vector<object_info> out;
    for (const auto& [name, bytes] : objects) {
      auto c = claimed_size.find(name);
      out.push_back({name, c != claimed_size.end() ? c->second : bytes.size()});
    }
    return out;
  }

  status remove(const std::string& name) override {
    objects.erase(name);
    claimed_size.erase(name);
    return {};
  }

  void sweep_stale_writes(const std::function<bool(const std::string&)>&) override {}

 private:
  class writer : public object_writer {
   public:
    writer(memory_store& s, std::string name) : s_(s), name_(std::move(name)) {}
    status write(const void* data, size_t size) override {
      buf_.append(static_cast<const char*>(data), size);
      return {};
    }
    status commit() override {
      s_.objects[name_] = std::move(buf_);
      s_.claimed_size.erase(name_);
      return {};
    }

   private:
    memory_store& s_;
    std::string name_, buf_;
  };
  std::string location_ = "memory://fuzz";
};

}  // namespace dtactor::fuzz
