#include "runtime/checkpoint_store.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <string_view>
#include <system_error>

#include "runtime/fs.hpp"
#include "runtime/hash.hpp"

namespace dtactor {

namespace {

constexpr std::string_view magic = "DTACKPT1";
constexpr uint64_t prefix_size = 12;  // magic + u32 meta length
constexpr uint64_t trailer_size = 8;  // u64 meta checksum

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t get_le(std::string_view in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(in[at + i])) << (8 * i);
  return v;
}

std::string truncated(uint64_t expected, uint64_t has, bool at_least) {
  return "truncated: expected " + std::string(at_least ? "at least " : "") + std::to_string(expected) +
         " bytes, file has " + std::to_string(has);
}

struct header {
  pb::checkpoint_meta meta;
  uint64_t header_size = 0;  // offset of the first section
};

// Checks everything the header alone can tell, including that the file size
// matches the sections the meta lists. `bytes` starts at offset 0 and holds
// the whole header, or the whole file when that is shorter.
result<header> parse_header(std::string_view bytes, uint64_t file_size) {
  if (file_size < magic.size()) {
    if (magic.substr(0, bytes.size()) == bytes) return make_error(truncated(prefix_size, file_size, true));
    return make_error("not a dtactor checkpoint (bad magic)");
  }
  if (bytes.substr(0, magic.size()) != magic) return make_error("not a dtactor checkpoint (bad magic)");
  if (file_size < prefix_size) return make_error(truncated(prefix_size, file_size, true));
  const uint64_t meta_size = get_le(bytes, magic.size(), 4);
  header h;
  h.header_size = prefix_size + meta_size + trailer_size;
  if (file_size < h.header_size || bytes.size() < h.header_size)
    return make_error(truncated(h.header_size, file_size, true));
  std::string_view meta_bytes = bytes.substr(prefix_size, meta_size);
  if (hash64(meta_bytes.data(), meta_bytes.size()) != get_le(bytes, prefix_size + meta_size, 8))
    return make_error("meta checksum mismatch (header corrupt)");
  if (!h.meta.ParseFromArray(meta_bytes.data(), static_cast<int>(meta_bytes.size())))
    return make_error("meta does not parse");
  if (h.meta.format_version() != checkpoint_format_version)
    return make_error("unsupported format version " + std::to_string(h.meta.format_version()) + " (this build reads " +
                      std::to_string(checkpoint_format_version) + ")");
  uint64_t expected = h.header_size;
  std::set<std::string> names;
  for (const auto& s : h.meta.sections()) {
    if (!names.insert(s.name()).second) return make_error("duplicate section '" + s.name() + "'");
    if (s.size() > std::numeric_limits<uint64_t>::max() - expected)
      return make_error("section '" + s.name() + "' has an impossible size");
    expected += s.size();
  }
  if (file_size < expected) return make_error(truncated(expected, file_size, false));
  if (file_size > expected)
    return make_error("trailing data: expected " + std::to_string(expected) + " bytes, file has " +
                      std::to_string(file_size));
  return h;
}

// An open file descriptor, closed on scope exit.
class file_reader {
 public:
  explicit file_reader(const std::string& path) : fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (fd_ < 0) {
      error_ = errno;
      return;
    }
    struct stat sb {};
    if (::fstat(fd_, &sb) != 0) error_ = errno;
    else if (S_ISDIR(sb.st_mode)) error_ = EISDIR;
    size_ = static_cast<uint64_t>(sb.st_size);
  }
  ~file_reader() {
    if (fd_ >= 0) ::close(fd_);
  }
  file_reader(const file_reader&) = delete;
  file_reader& operator=(const file_reader&) = delete;

  // 0 or the errno of opening the file.
  int error() const { return error_; }
  uint64_t size() const { return size_; }

  // Reads up to `size` bytes at `offset`; fewer only at end of file.
  result<std::string> read(uint64_t offset, uint64_t size) const {
    std::string out(size, '\0');
    uint64_t used = 0;
    while (used < size) {
      ssize_t n = ::pread(fd_, out.data() + used, size - used, static_cast<off_t>(offset + used));
      if (n < 0) {
        if (errno == EINTR) continue;
        return make_error(std::string("read failed: ") + std::strerror(errno));
      }
      if (n == 0) break;
      used += static_cast<uint64_t>(n);
    }
    out.resize(used);
    return out;
  }

 private:
  int fd_;
  int error_ = 0;
  uint64_t size_ = 0;
};

result<header> read_header(const file_reader& file) {
  if (file.error()) return make_error(std::string("cannot read: ") + std::strerror(file.error()));
  auto prefix = file.read(0, std::min<uint64_t>(file.size(), prefix_size));
  if (!prefix) return prefix.err();
  if (prefix->size() < prefix_size || prefix->substr(0, magic.size()) != magic)
    return parse_header(*prefix, file.size());
  const uint64_t header_size = prefix_size + get_le(*prefix, magic.size(), 4) + trailer_size;
  if (header_size > file.size()) return parse_header(*prefix, file.size());
  auto bytes = file.read(0, std::min<uint64_t>(file.size(), header_size));
  if (!bytes) return bytes.err();
  return parse_header(*bytes, file.size());
}

result<loaded_checkpoint> load_file(const std::string& path) {
  file_reader file(path);
  auto h = read_header(file);
  if (!h) return h.err();
  loaded_checkpoint out;
  out.path = path;
  uint64_t offset = h->header_size;
  for (const auto& s : h->meta.sections()) {
    auto bytes = file.read(offset, s.size());
    if (!bytes) return bytes.err();
    if (bytes->size() != s.size()) return make_error(truncated(offset + s.size(), offset + bytes->size(), false));
    if (hash64(bytes->data(), bytes->size()) != s.xxh3())
      return make_error("checksum mismatch in section '" + s.name() + "'");
    out.sections.emplace(s.name(), std::move(*bytes));
    offset += s.size();
  }
  out.meta = std::move(h->meta);
  return out;
}

// The step a checkpoint file name stands for; only names exactly as
// checkpoint_file_name() writes them count.
std::optional<int64_t> step_of(const std::string& name) {
  constexpr std::string_view prefix = "ckpt-", suffix = ".dtc";
  if (name.size() < prefix.size() + 9 + suffix.size() || name.size() > prefix.size() + 18 + suffix.size())
    return std::nullopt;
  if (name.compare(0, prefix.size(), prefix) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return std::nullopt;
  int64_t step = 0;
  for (size_t i = prefix.size(); i < name.size() - suffix.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  if (checkpoint_file_name(step) != name) return std::nullopt;
  return step;
}

struct found_file {
  std::string path;
  int64_t step;
};

// Checkpoint files in `dir`, ascending by step.
result<std::vector<found_file>> find_checkpoints(const std::string& dir) {
  std::vector<found_file> out;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec), end;
  if (ec) return make_error("cannot list checkpoint directory '" + dir + "': " + ec.message());
  for (; it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (auto step = step_of(name)) out.push_back({it->path().string(), *step});
  }
  if (ec) return make_error("cannot list checkpoint directory '" + dir + "': " + ec.message());
  std::sort(out.begin(), out.end(), [](const found_file& a, const found_file& b) { return a.step < b.step; });
  return out;
}

struct scanned_file {
  std::string path;
  int64_t step;
  std::optional<pb::checkpoint_meta> meta;  // set when header and size check out
};

std::string step_mismatch(int64_t name_step, int64_t meta_step) {
  return "file name says step " + std::to_string(name_step) + " but its meta says step " + std::to_string(meta_step);
}

// Like find_checkpoints, with each file's meta read and checked (not its
// section checksums).
std::vector<scanned_file> scan(const std::string& dir) {
  std::vector<scanned_file> out;
  auto files = find_checkpoints(dir);
  if (!files) return out;
  for (auto& f : *files) {
    scanned_file s{std::move(f.path), f.step, std::nullopt};
    file_reader file(s.path);
    if (auto h = read_header(file); h && h->meta.step() == s.step) s.meta = std::move(h->meta);
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace

std::string checkpoint_file_name(int64_t step) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "ckpt-%09lld.dtc", static_cast<long long>(step));
  return buf;
}

checkpoint_store::checkpoint_store(std::string dir, checkpoint_policy policy, fs_env& env)
    : dir_(std::move(dir)), policy_(std::move(policy)), env_(&env) {}

result<checkpoint_store> checkpoint_store::open(std::string dir, checkpoint_policy policy, fs_env& env) {
  if (policy.keep_last < 1)
    return make_error("checkpoint.keep_last must be at least 1 (got " + std::to_string(policy.keep_last) + ")");
  if (auto st = ensure_writable_dir(dir); !st)
    return make_error("checkpoint " + st.message() + " (set checkpoint.dir to a writable directory)");
  // Temp files of this process may belong to a save in flight; any other
  // process's are leftovers of a writer that died (or a stale one: fenced).
  const std::string own_marker = ".tmp." + std::to_string(::getpid()) + ".";
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (name.rfind("ckpt-", 0) == 0 && is_atomic_temp_name(name) && name.find(own_marker) == std::string::npos)
      (void)remove_file(it->path().string());
  }
  return checkpoint_store(std::move(dir), std::move(policy), env);
}

result<std::string> checkpoint_store::save(pb::checkpoint_meta meta,
                                           const std::vector<std::pair<std::string, std::string>>& sections) {
  auto refuse = [](const std::string& why) { return make_error("checkpoint not saved: " + why); };
  if (meta.step() < 0) return refuse("negative step " + std::to_string(meta.step()));
  const uint64_t newest = newest_generation();
  if (meta.generation() < newest)
    return make_error("refusing checkpoint from generation " + std::to_string(meta.generation()) + ": generation " +
                      std::to_string(newest) + " already wrote here");
  meta.set_format_version(checkpoint_format_version);
  meta.clear_sections();
  std::set<std::string> names;
  for (const auto& [name, bytes] : sections) {
    if (name.empty()) return refuse("a section has an empty name");
    if (!names.insert(name).second) return refuse("duplicate section '" + name + "'");
    auto* s = meta.add_sections();
    s->set_name(name);
    s->set_size(bytes.size());
    s->set_xxh3(hash64(bytes.data(), bytes.size()));
  }
  std::string meta_bytes;
  if (!meta.SerializeToString(&meta_bytes) || meta_bytes.size() > std::numeric_limits<uint32_t>::max())
    return refuse("meta does not serialize");
  std::string head;
  head.reserve(prefix_size + meta_bytes.size() + trailer_size);
  head.append(magic);
  put_le(head, meta_bytes.size(), 4);
  head.append(meta_bytes);
  put_le(head, hash64(meta_bytes.data(), meta_bytes.size()), 8);

  std::vector<std::string_view> pieces{head};
  for (const auto& section : sections) pieces.emplace_back(section.second);
  const std::string path = (std::filesystem::path(dir_) / checkpoint_file_name(meta.step())).string();
  if (auto st = write_file_atomic(path, pieces, *env_); !st) return refuse(st.message());
  rotate(path);
  return path;
}

void checkpoint_store::rotate(const std::string& just_written) const {
  std::vector<scanned_file> valid;
  for (auto& f : scan(dir_))
    if (f.meta) valid.push_back(std::move(f));
  std::set<std::string> keep{just_written};
  for (size_t i = 0; i < valid.size() && i < static_cast<size_t>(policy_.keep_last); ++i)
    keep.insert(valid[valid.size() - 1 - i].path);
  if (policy_.keep_best && !policy_.best_metric.empty()) {
    const scanned_file* best = nullptr;
    double best_value = 0;
    for (const auto& f : valid) {  // ascending: on a tie the newer wins
      auto it = f.meta->metrics().find(policy_.best_metric);
      if (it == f.meta->metrics().end() || std::isnan(it->second)) continue;
      const double v = it->second;
      if (!best || (policy_.higher_is_better ? v >= best_value : v <= best_value)) {
        best = &f;
        best_value = v;
      }
    }
    if (best) keep.insert(best->path);
  }
  for (const auto& f : valid)
    if (!keep.count(f.path)) (void)remove_file(f.path);
}

result<loaded_checkpoint> checkpoint_store::load(const std::string& path) { return load_file(path); }

result<std::optional<loaded_checkpoint>> checkpoint_store::load_newest_valid(
    const std::function<void(const std::string&, const std::string&)>& on_skip) const {
  auto files = find_checkpoints(dir_);
  if (!files) return files.err();
  for (auto it = files->rbegin(); it != files->rend(); ++it) {
    auto loaded = load_file(it->path);
    std::string reason;
    if (!loaded) reason = loaded.message();
    else if (loaded->meta.step() != it->step) reason = step_mismatch(it->step, loaded->meta.step());
    if (reason.empty()) return std::optional<loaded_checkpoint>(std::move(*loaded));
    if (on_skip) on_skip(it->path, reason);
  }
  return std::optional<loaded_checkpoint>();
}

std::vector<checkpoint_entry> checkpoint_store::list() const {
  std::vector<checkpoint_entry> out;
  for (auto& f : scan(dir_)) {
    checkpoint_entry e{std::move(f.path), f.step, {}};
    if (f.meta) e.metrics.insert(f.meta->metrics().begin(), f.meta->metrics().end());
    out.push_back(std::move(e));
  }
  return out;
}

uint64_t checkpoint_store::newest_generation() const {
  uint64_t newest = 0;
  for (const auto& f : scan(dir_))
    if (f.meta) newest = std::max<uint64_t>(newest, f.meta->generation());
  return newest;
}

}  // namespace dtactor
