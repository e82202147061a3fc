#include "data/webdataset.hpp"

#include <algorithm>
#include <cctype>
#include <cstring>

#include "data/npy.hpp"

namespace dtactor {

namespace {

constexpr uint64_t block = 512;
constexpr size_t max_extra = 64 * 1024;  // a GNU long name or a pax header's records

uint64_t padded(uint64_t n) { return (n + block - 1) / block * block; }

std::string field(const uint8_t* b, size_t at, size_t len) {
  const auto* p = reinterpret_cast<const char*>(b + at);
  return std::string(p, strnlen(p, len));
}

// An octal number field (leading spaces, then digits, then NUL or spaces),
// or GNU's base-256 (first byte's top bit set).
bool number(const uint8_t* b, size_t at, size_t len, uint64_t& out) {
  out = 0;
  if (b[at] & 0x80) {
    if (b[at] != 0x80) return false;  // negative, or too large
    for (size_t i = at + 1; i < at + len; ++i) {
      if (out >> 55) return false;
      out = (out << 8) | b[i];
    }
    return true;
  }
  size_t i = at;
  while (i < at + len && b[i] == ' ') ++i;
  bool digits = false;
  for (; i < at + len && b[i] >= '0' && b[i] <= '7'; ++i) {
    if (out >> 60) return false;
    out = out * 8 + static_cast<uint64_t>(b[i] - '0');
    digits = true;
  }
  for (; i < at + len; ++i)
    if (b[i] != 0 && b[i] != ' ') return false;
  return digits;
}

std::string printable_name(const std::string& s) {
  std::string out;
  for (unsigned char c : s.substr(0, 200)) {
    if (c >= 0x20 && c < 0x7f) out += static_cast<char>(c);
    else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  if (s.size() > 200) out += "...";
  return out;
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string extension_of(const std::string& name) {
  const auto slash = name.rfind('/');
  const std::string base = slash == std::string::npos ? name : name.substr(slash + 1);
  const auto dot = base.rfind('.');
  return dot == std::string::npos ? "" : lower(base.substr(dot + 1));
}

}  // namespace

tar_scanner::tar_scanner(std::string where, on_entry sink) : where_(std::move(where)), sink_(std::move(sink)) {}

error tar_scanner::fail(const std::string& what) const { return make_error(where_ + ": not a valid tar archive: " + what); }

status tar_scanner::header_block(const uint8_t* b) {
  const uint64_t header_at = at_ - block;
  if (std::all_of(b, b + block, [](uint8_t c) { return c == 0; })) {
    state_ = state::end;  // the end-of-archive block; what follows is padding
    return {};
  }
  uint64_t stored = 0;
  if (!number(b, 148, 8, stored)) return fail("the header at byte " + std::to_string(header_at) + " has no checksum (is this a tar file?)");
  uint64_t sum = 0;
  for (uint64_t i = 0; i < block; ++i) sum += (i >= 148 && i < 156) ? ' ' : b[i];
  if (sum != stored) return fail("the header at byte " + std::to_string(header_at) + " has a wrong checksum (a damaged or truncated archive?)");
  uint64_t size = 0;
  if (!number(b, 124, 12, size)) return fail("the header at byte " + std::to_string(header_at) + " has a size that is not a number");
  if (have_next_size_) {
    size = next_size_;
    have_next_size_ = false;
  }
  const char type = static_cast<char>(b[156]);
  std::string name = std::move(next_name_);
  next_name_.clear();
  if (name.empty()) {
    name = field(b, 0, 100);
    if (std::memcmp(b + 257, "ustar", 5) == 0) {
      const std::string prefix = field(b, 345, 155);
      if (!prefix.empty()) name = prefix + "/" + name;
    }
  }
  while (name.rfind("./", 0) == 0) name.erase(0, 2);
  remaining_ = padded(size);
  payload_ = size;
  extra_.clear();
  if (type == 'L' || type == 'x') {
    if (size > max_extra)
      return fail((type == 'L' ? "a long file name" : "a pax header") + std::string(" at byte ") + std::to_string(header_at) + " claims " +
                  std::to_string(size) + " bytes (at most " + std::to_string(max_extra) + ")");
    state_ = type == 'L' ? state::long_name : state::pax;
  } else {
    state_ = state::skip;
    if (type == '0' || type == '\0' || type == '7') {
      if (auto st = sink_(tar_entry{name, at_, size}); !st) return st;
    }
  }
  if (remaining_ == 0) return data_done();
  return {};
}

status tar_scanner::data_done() {
  if (state_ == state::long_name) {
    next_name_ = extra_.substr(0, strnlen(extra_.data(), extra_.size()));
  } else if (state_ == state::pax) {
    // Records "LEN key=value\n", LEN counting the whole record.
    size_t at = 0;
    while (at < extra_.size()) {
      size_t sp = at;
      uint64_t len = 0;
      while (sp < extra_.size() && std::isdigit(static_cast<unsigned char>(extra_[sp])) && len < max_extra) len = len * 10 + static_cast<uint64_t>(extra_[sp++] - '0');
      if (sp == at || sp >= extra_.size() || extra_[sp] != ' ' || len <= sp - at + 1 || at + len > extra_.size() || extra_[at + len - 1] != '\n') {
        if (std::all_of(extra_.begin() + static_cast<std::ptrdiff_t>(at), extra_.end(), [](char c) { return c == 0; })) break;
        return fail("a pax header before byte " + std::to_string(at_) + " has a malformed record");
      }
      const std::string rec = extra_.substr(sp + 1, at + len - 1 - (sp + 1));
      const auto eq = rec.find('=');
      if (eq == std::string::npos) return fail("a pax header before byte " + std::to_string(at_) + " has a record without '='");
      const std::string key = rec.substr(0, eq), value = rec.substr(eq + 1);
      if (key == "path") {
        next_name_ = value;
      } else if (key == "size") {
        uint64_t v = 0;
        bool ok = !value.empty() && value.size() < 19;
        for (char c : value) ok = ok && std::isdigit(static_cast<unsigned char>(c)) && (v = v * 10 + static_cast<uint64_t>(c - '0'), true);
        if (!ok) return fail("a pax header before byte " + std::to_string(at_) + " has a size that is not a number");
        next_size_ = v;
        have_next_size_ = true;
      }
      at += len;
    }
  }
  extra_.clear();
  state_ = state::header;
  return {};
}

status tar_scanner::feed(const uint8_t* p, size_t n) {
  while (n > 0) {
    if (state_ == state::end) {
      at_ += n;
      return {};
    }
    if (state_ == state::header) {
      const size_t take = std::min(n, static_cast<size_t>(block) - block_fill_);
      std::memcpy(block_ + block_fill_, p, take);
      block_fill_ += take;
      p += take;
      n -= take;
      at_ += take;
      if (block_fill_ == block) {
        block_fill_ = 0;
        if (auto st = header_block(block_); !st) return st;
      }
      continue;
    }
    const size_t take = static_cast<size_t>(std::min<uint64_t>(n, remaining_));
    if ((state_ == state::long_name || state_ == state::pax) && extra_.size() < payload_) {
      const size_t keep = static_cast<size_t>(std::min<uint64_t>(take, payload_ - extra_.size()));
      extra_.append(reinterpret_cast<const char*>(p), keep);
    }
    p += take;
    n -= take;
    at_ += take;
    remaining_ -= take;
    if (remaining_ == 0)
      if (auto st = data_done(); !st) return st;
  }
  return {};
}

status tar_scanner::finish() {
  if (state_ == state::end || (state_ == state::header && block_fill_ == 0)) return {};
  if (state_ == state::header) return fail("it ends inside a header, at byte " + std::to_string(at_) + " (truncated?)");
  return fail("it ends inside a file, " + std::to_string(remaining_) + " bytes short (truncated?)");
}

const tar_entry* tar_sample::member(const std::string& ext) const {
  for (const auto& [e, entry] : members)
    if (e == ext) return &entry;
  return nullptr;
}

tar_sample_grouper::tar_sample_grouper(std::string where, on_sample sink) : where_(std::move(where)), sink_(std::move(sink)) {}

status tar_sample_grouper::add(const tar_entry& e) {
  const auto slash = e.name.rfind('/');
  const std::string base = slash == std::string::npos ? e.name : e.name.substr(slash + 1);
  const auto dot = base.find('.');
  // No extension, a hidden file, or WebDataset's __meta__ files: no sample's.
  if (dot == std::string::npos || dot == 0 || base.rfind("__", 0) == 0) return {};
  const std::string key = e.name.substr(0, e.name.size() - base.size() + dot);
  const std::string ext = lower(base.substr(dot + 1));
  if (key != current_.key || current_.members.empty()) {
    if (auto st = finish(); !st) return st;
    if (seen_.count(key))
      return make_error(where_ + ": sample '" + printable_name(key) +
                        "' comes back after other samples' files: a sample's files must be consecutive (write the tar sample by sample, e.g. sorted by name)");
    current_.key = key;
  }
  if (current_.member(ext)) return make_error(where_ + ": sample '" + printable_name(key) + "' has two '." + printable_name(ext) + "' files");
  current_.members.emplace_back(ext, e);
  return {};
}

status tar_sample_grouper::finish() {
  if (current_.members.empty()) return {};
  seen_.insert(current_.key);
  tar_sample s = std::move(current_);
  current_ = tar_sample{};
  return sink_(std::move(s));
}

result<std::vector<tar_sample>> read_tar_samples(const uint8_t* data, size_t size, const std::string& where) {
  std::vector<tar_sample> out;
  tar_sample_grouper group(where, [&](tar_sample&& s) -> status {
    out.push_back(std::move(s));
    return {};
  });
  tar_scanner scan(where, [&](const tar_entry& e) -> status {
    if (e.offset + e.size > size) return make_error(where + ": not a valid tar archive: '" + printable_name(e.name) + "' runs past the end (truncated?)");
    return group.add(e);
  });
  if (auto st = scan.feed(data, size); !st) return st.err();
  if (auto st = scan.finish(); !st) return st.err();
  if (auto st = group.finish(); !st) return st.err();
  return out;
}

namespace {

class tar_counter final : public record_counter {
 public:
  explicit tar_counter(const std::string& where)
      : group_(where, [this](tar_sample&&) -> status {
          ++count_;
          return {};
        }),
        scan_(where, [this](const tar_entry& e) { return group_.add(e); }) {}
  status update(const uint8_t* data, size_t size) override { return scan_.feed(data, size); }
  result<int64_t> finish(uint64_t) override {
    if (auto st = scan_.finish(); !st) return st.err();
    if (auto st = group_.finish(); !st) return st.err();
    return count_;
  }

 private:
  int64_t count_ = 0;
  tar_sample_grouper group_;
  tar_scanner scan_;
};

class npy_counter final : public record_counter {
 public:
  explicit npy_counter(std::string where) : where_(std::move(where)) {}
  status update(const uint8_t* data, size_t size) override {
    if (head_.size() < 65536) head_.append(reinterpret_cast<const char*>(data), std::min<size_t>(size, 65536 - head_.size()));
    return {};
  }
  result<int64_t> finish(uint64_t total) override {
    auto h = parse_npy_header(head_, total);
    if (!h) return make_error(where_ + ": " + h.message());
    return h->shape[0];
  }

 private:
  std::string where_, head_;
};

class line_counter final : public record_counter {
 public:
  status update(const uint8_t* data, size_t size) override {
    count_ += std::count(data, data + size, static_cast<uint8_t>('\n'));
    if (size) last_ = data[size - 1];
    return {};
  }
  result<int64_t> finish(uint64_t total) override { return count_ + (total > 0 && last_ != '\n' ? 1 : 0); }

 private:
  int64_t count_ = 0;
  uint8_t last_ = '\n';
};

}  // namespace

std::unique_ptr<record_counter> record_counter::for_name(const std::string& name, const std::string& where) {
  const std::string ext = extension_of(name);
  if (ext == "tar") return std::make_unique<tar_counter>(where);
  if (ext == "npy") return std::make_unique<npy_counter>(where);
  if (ext == "csv" || ext == "tsv" || ext == "jsonl" || ext == "txt") return std::make_unique<line_counter>();
  return nullptr;
}

result<int64_t> count_records(const std::string& name, const uint8_t* data, size_t size, const std::string& where) {
  auto c = record_counter::for_name(name, where);
  if (!c) return int64_t{-1};
  if (auto st = c->update(data, size); !st) return st.err();
  return c->finish(size);
}

}  // namespace dtactor
