// Sharded data sets (data/data_shards.hpp, docs/data.md): shard specs,
// the shard index, and the reader with its node-wide cache of S3 shards.
#include "data/data_shards.hpp"
#include "data/webdataset.hpp"

#include <fcntl.h>
#include <fnmatch.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "base/hash.hpp"
#include "storage/object_store.hpp"
#include "storage/s3_store.hpp"

namespace dtactor {

namespace {

constexpr uint64_t chunk_bytes = 8ull << 20;           // one ranged GET / one read while hashing
constexpr uint64_t max_range_names = 1'000'000;        // what {A..B} ranges may expand to, all together
constexpr size_t max_index_depth = 8;                  // nesting a real index never passes
constexpr const char* locks_subdir = ".locks";         // lock files of the cache directory
constexpr const char* space_lock_name = "space.lock";  // held while the cache's bytes are counted and reserved

std::string os_reason(int err) { return std::strerror(err); }

bool is_s3(std::string_view s) { return s.rfind("s3://", 0) == 0; }

bool has_glob(std::string_view s) { return s.find_first_of("*?[") != std::string_view::npos; }

std::string trim(const std::string& s) {
  const auto a = s.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return {};
  const auto b = s.find_last_not_of(" \t\r\n");
  return s.substr(a, b - a + 1);
}

// Names from listings and index files are outside bytes: messages show
// them on one line, control bytes escaped, long ones cut.
std::string printable(std::string_view s) {
  std::string out;
  for (unsigned char c : s.substr(0, 300)) {
    if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > 300) out += "...";
  return out;
}

// "s3://b/p/name" -> ("s3://b/p", "name"); "/d/name" -> ("/d", "name").
std::pair<std::string, std::string> split_url(const std::string& url) {
  const auto slash = url.rfind('/');
  if (slash == std::string::npos) return {".", url};
  std::string loc = url.substr(0, slash);
  if (loc.empty()) loc = "/";
  return {loc, url.substr(slash + 1)};
}

std::string join_url(const std::string& location, const std::string& name) { return location == "/" ? "/" + name : location + "/" + name; }

std::string digest_of(uint64_t bytes, uint64_t xxh3) { return std::to_string(bytes) + ":" + hex64(xxh3); }

// Expands every {A..B} (decimal, zero-padded as bash pads: to the wider
// end when either has a leading zero) of one item of a spec.
result<std::vector<std::string>> expand_ranges(const std::string& item, bool& had_range) {
  std::vector<std::string> out{""};
  size_t at = 0;
  while (at <= item.size()) {
    const size_t open = item.find('{', at);
    if (open == std::string::npos) {
      for (auto& o : out) o += item.substr(at);
      break;
    }
    const size_t close = item.find('}', open);
    if (close == std::string::npos) return make_error("'" + printable(item) + "': '{' without '}'");
    const std::string inner = item.substr(open + 1, close - open - 1);
    const size_t dots = inner.find("..");
    const std::string a = inner.substr(0, dots), b = dots == std::string::npos ? "" : inner.substr(dots + 2);
    auto digits = [](const std::string& s) {
      return !s.empty() && s.size() <= 18 && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
    };
    if (dots == std::string::npos || !digits(a) || !digits(b))
      return make_error("'" + printable(item) + "': '{" + printable(inner) + "}' is not a range of numbers like {000..127}");
    had_range = true;
    const uint64_t lo = std::stoull(a), hi = std::stoull(b);
    const bool pad = (a.size() > 1 && a[0] == '0') || (b.size() > 1 && b[0] == '0');
    const size_t width = pad ? std::max(a.size(), b.size()) : 0;
    const uint64_t count = (hi >= lo ? hi - lo : lo - hi) + 1;
    if (count > max_range_names || count * out.size() > max_range_names)
      return make_error("'" + printable(item) + "' names more than " + std::to_string(max_range_names) + " files");
    const std::string literal = item.substr(at, open - at);
    std::vector<std::string> next;
    next.reserve(count * out.size());
    for (const auto& prefix : out)
      for (uint64_t k = 0; k < count; ++k) {
        std::string n = std::to_string(hi >= lo ? lo + k : lo - k);
        if (n.size() < width) n.insert(0, width - n.size(), '0');
        next.push_back(prefix + literal + n);
      }
    out = std::move(next);
    at = close + 1;
  }
  return out;
}

// How deep [ and { nest outside strings: nlohmann's parser is iterative,
// but nothing a real index holds nests deeper than 3.
size_t json_depth(const std::string& text) {
  size_t depth = 0, most = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      most = std::max(most, ++depth);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return most;
}

// Opens stores and lists locations once per resolve.
class resolver {
 public:
  resolver(std::string spec, std::string endpoint) : spec_(std::move(spec)), endpoint_(std::move(endpoint)) {}

  error fail(const std::string& what) const { return make_error("data '" + printable(spec_) + "': " + what); }

  result<object_store*> store_at(const std::string& location) {
    auto it = stores_.find(location);
    if (it != stores_.end()) return it->second.get();
    auto s = open_object_store_readonly(location, endpoint_);
    if (!s) return fail(s.message());
    return stores_.emplace(location, std::move(s.value())).first->second.get();
  }

  result<const std::vector<object_info>*> listing(const std::string& location) {
    auto it = listings_.find(location);
    if (it != listings_.end()) return &it->second;
    auto store = store_at(location);
    if (!store) return store.err();
    auto l = store.value()->list();
    if (!l) return fail(l.message());
    return &listings_.emplace(location, std::move(l.value())).first->second;
  }

  // The shards of `spec`, sorted and unique, with digests from the indexes
  // when `use_index`.
  result<std::vector<shard_info>> resolve(bool use_index) {
    std::vector<shard_info> out;
    size_t items = 0;
    std::string rest = spec_;
    for (size_t start = 0; start <= rest.size();) {
      size_t comma = rest.find(',', start);
      if (comma == std::string::npos) comma = rest.size();
      const std::string item = trim(rest.substr(start, comma - start));
      start = comma + 1;
      if (item.empty()) continue;
      ++items;
      bool had_range = false;
      auto names = expand_ranges(item, had_range);
      if (!names) return fail(names.message());
      for (const auto& n : names.value())
        if (auto st = add(n, had_range, out); !st) return st.err();
    }
    if (items == 0) return fail("names no shards (an empty list)");
    std::sort(out.begin(), out.end(), [](const shard_info& a, const shard_info& b) { return a.url < b.url; });
    out.erase(std::unique(out.begin(), out.end(), [](const shard_info& a, const shard_info& b) { return a.url == b.url; }), out.end());
    if (use_index)
      if (auto st = apply_indexes(out); !st) return st.err();
    return out;
  }

 private:
  status add(const std::string& pattern, bool from_range, std::vector<shard_info>& out) {
    std::string location, pat;
    if (is_s3(pattern)) {
      const auto slash = pattern.find('/', 5);
      if (slash == std::string::npos)
        return fail("'" + printable(pattern) + "' names a bucket, not shards: add a key pattern (s3://BUCKET/PREFIX/train-*.bin)");
      std::tie(location, pat) = split_url(pattern);
      if (location.size() <= 5) return fail("'" + printable(pattern) + "' has no bucket");
    } else {
      const std::filesystem::path p(pattern);
      pat = p.filename().string();
      location = absolute_location(p.has_parent_path() ? p.parent_path().string() : std::string("."));
      while (location.size() > 1 && location.back() == '/') location.pop_back();
    }
    if (pat.empty() || pat == "." || pat == "..")
      return fail("'" + printable(pattern) + "' names a directory or prefix, not shards: add a file pattern (DIR/train-*.bin)");
    if (has_glob(location.substr(is_s3(location) ? 5 : 0))) {
      std::error_code ec;
      if (is_s3(location) || !std::filesystem::is_directory(location, ec))
        return fail("'" + printable(pattern) + "': a glob may only be in the file name (the last path component)");
    }
    auto store = store_at(location);
    if (!store) return store.err();
    if (has_glob(pat)) {
      auto l = listing(location);
      if (!l) return l.err();
      size_t matched = 0;
      for (const auto& o : *l.value()) {
        if (o.name == shard_index_name || ::fnmatch(pat.c_str(), o.name.c_str(), FNM_PERIOD) != 0) continue;
        out.push_back({join_url(location, o.name), o.size, ""});
        ++matched;
      }
      if (matched == 0)
        return fail(std::string(from_range ? "a name of its range matches nothing: " : "nothing matches ") + "'" +
                    printable(join_url(location, pat)) + "'");
      return {};
    }
    auto size = store.value()->size_of(pat);
    if (!size) return fail(size.message());
    if (!size.value()) return fail("'" + printable(join_url(location, pat)) + "' " + (from_range ? "of its range " : "") + "does not exist");
    out.push_back({join_url(location, pat), *size.value(), ""});
    return {};
  }

  status apply_indexes(std::vector<shard_info>& shards) {
    std::map<std::string, std::vector<shard_info*>> by_location;
    for (auto& s : shards) by_location[split_url(s.url).first].push_back(&s);
    for (auto& [location, group] : by_location) {
      auto store = store_at(location);
      if (!store) return store.err();
      auto present = store.value()->size_of(shard_index_name);
      if (!present) return fail(present.message());
      if (!present.value()) continue;
      const std::string where = join_url(location, shard_index_name);
      auto text = store.value()->get(shard_index_name, object_store::max_small_object_bytes);
      if (!text) return fail(text.message());
      auto index = parse_shard_index(text.value(), where);
      if (!index) return fail(index.message());
      for (shard_info* s : group) {
        const std::string name = split_url(s->url).second;
        auto it = index->find(name);
        if (it == index->end())
          return fail("shard " + printable(s->url) + " is not in " + printable(where) +
                      " (added after it was written?): rerun `dtactor data index` over the shards");
        if (it->second.bytes != s->bytes)
          return fail("shard " + printable(s->url) + ": " + std::to_string(s->bytes) + " bytes, the index says " + std::to_string(it->second.bytes));
        s->digest = it->second.digest;
        s->records = it->second.records;
      }
    }
    return {};
  }

  std::string spec_, endpoint_;
  std::map<std::string, std::unique_ptr<object_store>> stores_;
  std::map<std::string, std::vector<object_info>> listings_;
};

}  // namespace

bool names_shards(const std::string& spec) {
  const std::string s = trim(spec);
  if (is_s3(s) || s.find(',') != std::string::npos) return true;
  if (has_glob(split_url(s).second)) return true;
  const auto open = s.find('{');
  return open != std::string::npos && s.find("..", open) != std::string::npos && s.find('}', open) != std::string::npos;
}

result<std::map<std::string, shard_index_entry>> parse_shard_index(const std::string& text, const std::string& where) {
  const std::string fix = "; rewrite it with `dtactor data index`";
  auto bad = [&](const std::string& what) { return make_error("shard index " + printable(where) + " is malformed: " + what + fix); };
  if (json_depth(text) > max_index_depth) return bad("nested deeper than an index is");
  const auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded()) return bad("not JSON");
  if (!j.is_object()) return bad("not a JSON object");
  const auto version = j.find("version");
  if (version == j.end() || !version->is_number_unsigned() || version->get<uint64_t>() != 1) return bad("\"version\" is not 1");
  const auto list = j.find("shards");
  if (list == j.end() || !list->is_array()) return bad("no \"shards\" array");
  std::map<std::string, shard_index_entry> out;
  size_t n = 0;
  for (const auto& e : *list) {
    const std::string which = "entry " + std::to_string(n++);
    if (!e.is_object()) return bad(which + " is not an object");
    const auto name = e.find("name"), bytes = e.find("bytes"), xxh3 = e.find("xxh3");
    if (name == e.end() || !name->is_string() || name->get<std::string>().empty()) return bad(which + " has no \"name\"");
    const std::string nm = name->get<std::string>();
    if (nm.find('/') != std::string::npos || nm == "." || nm == "..") return bad(which + ": \"" + printable(nm) + "\" is not a file name");
    if (bytes == e.end() || !bytes->is_number_unsigned()) return bad(which + " (" + printable(nm) + ") has no \"bytes\" count");
    if (xxh3 == e.end() || !xxh3->is_string()) return bad(which + " (" + printable(nm) + ") has no \"xxh3\"");
    const std::string h = xxh3->get<std::string>();
    if (h.size() != 16 || !std::all_of(h.begin(), h.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }))
      return bad(which + " (" + printable(nm) + "): \"xxh3\" is not 16 lower-case hex digits");
    const uint64_t b = bytes->get<uint64_t>();
    int64_t records = -1;
    if (const auto r = e.find("records"); r != e.end()) {
      if (!r->is_number_unsigned() || r->get<uint64_t>() > b) return bad(which + " (" + printable(nm) + "): \"records\" is not a count");
      records = static_cast<int64_t>(r->get<uint64_t>());
    }
    if (!out.emplace(nm, shard_index_entry{b, std::to_string(b) + ":" + h, records}).second) return bad("\"" + printable(nm) + "\" is listed twice");
  }
  return out;
}

result<std::vector<shard_info>> resolve_shards(const std::string& spec, const std::string& s3_endpoint) {
  return resolver(spec, s3_endpoint).resolve(true);
}

std::string shard_set_digest(const std::vector<shard_info>& shards) {
  hasher h;
  uint64_t total = 0;
  for (const auto& s : shards) {
    const std::string bytes = std::to_string(s.bytes);
    h.update(s.url.data(), s.url.size());
    h.update("\0", 1);
    h.update(bytes.data(), bytes.size());
    h.update("\0", 1);
    h.update(s.digest.data(), s.digest.size());
    h.update("\n", 1);
    total += s.bytes;
  }
  return std::to_string(shards.size()) + "x" + std::to_string(total) + ":" + hex64(h.digest());
}

result<size_t> write_shard_index(const std::string& spec, const std::string& s3_endpoint, const shard_index_written& on_index) {
  resolver r(spec, s3_endpoint);
  auto shards = r.resolve(false);
  if (!shards) return shards.err();
  std::map<std::string, std::vector<const shard_info*>> by_location;
  for (const auto& s : shards.value()) by_location[split_url(s.url).first].push_back(&s);
  std::vector<char> buf(chunk_bytes);
  size_t indexed = 0;
  for (const auto& [location, group] : by_location) {
    auto store = r.store_at(location);
    if (!store) return store.err();
    object_store& objects = *store.value();
    std::map<std::string, shard_index_entry> entries;
    uint64_t group_bytes = 0;
    for (const shard_info* s : group) {
      const std::string name = split_url(s->url).second;
      hasher h;
      auto counter = record_counter::for_name(name, "shard " + printable(s->url));
      uint64_t at = 0;
      for (;;) {
        auto n = objects.read(name, at, buf.data(), buf.size());
        if (!n) return r.fail(n.message());
        h.update(buf.data(), n.value());
        if (counter)
          if (auto st = counter->update(reinterpret_cast<const uint8_t*>(buf.data()), n.value()); !st) return r.fail(st.message());
        at += n.value();
        if (n.value() < buf.size()) break;
      }
      if (at != s->bytes)
        return r.fail("shard " + printable(s->url) + " changed while it was indexed (" + std::to_string(s->bytes) + " bytes listed, " +
                      std::to_string(at) + " read)");
      int64_t records = -1;
      if (counter) {
        auto c = counter->finish(at);
        if (!c) return r.fail(c.message());
        records = c.value();
      }
      entries[name] = {at, digest_of(at, h.digest()), records};
      group_bytes += at;
    }
    // Keep what an older index says of other files still there unchanged.
    if (auto old_size = objects.size_of(shard_index_name); old_size && old_size.value()) {
      auto text = objects.get(shard_index_name, object_store::max_small_object_bytes);
      auto old =
          text ? parse_shard_index(text.value(), join_url(location, shard_index_name)) : result<std::map<std::string, shard_index_entry>>(text.err());
      auto listed = old ? r.listing(location) : result<const std::vector<object_info>*>(make_error(""));
      if (old && listed)
        for (const auto& o : *listed.value()) {
          auto e = old->find(o.name);
          if (e != old->end() && !entries.count(o.name) && e->second.bytes == o.size) entries.emplace(o.name, e->second);
        }
    }
    std::string text = "{\"version\":1,\"shards\":[\n";
    bool first = true;
    try {
      for (const auto& [name, e] : entries) {
        nlohmann::json j = {{"name", name}, {"bytes", e.bytes}, {"xxh3", e.digest.substr(e.digest.find(':') + 1)}};
        if (e.records >= 0) j["records"] = e.records;
        text += (first ? "" : ",\n") + j.dump();
        first = false;
      }
    } catch (const nlohmann::json::exception&) {
      return r.fail("a shard name in " + printable(location) + " is not UTF-8; the index (JSON) cannot hold it: rename the shard");
    }
    text += "\n]}\n";
    const std::string where = join_url(location, shard_index_name);
    status written = is_s3(location) ? objects.put(shard_index_name, text) : write_file_atomic(where, {text});
    if (!written) return r.fail("cannot write the index: " + written.message());
    if (on_index) on_index(where, group.size(), group_bytes);
    indexed += group.size();
  }
  return indexed;
}

// ---------------------------------------------------------------------------
// The reader.

namespace {

// An flock on a lock file of the cache: per shard (whoever fetches, checks
// or evicts the shard's cached file holds it) and one for the cache's space.
// The kernel drops a dead holder's lock. Lock files are never removed (a
// removed lock file would let two holders lock two different inodes).
class cache_lock {
 public:
  // wait: block until it is ours; else nullopt when someone holds it.
  static result<std::optional<cache_lock>> take(const std::string& path, bool wait) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return make_error("cannot open lock file '" + path + "': " + os_reason(errno));
    for (;;) {
      if (::flock(fd, LOCK_EX | (wait ? 0 : LOCK_NB)) == 0) break;
      const int err = errno;
      if (err == EINTR) continue;
      ::close(fd);
      if (err == EWOULDBLOCK && !wait) return std::optional<cache_lock>();
      return make_error("cannot lock '" + path + "': " + os_reason(err));
    }
    cache_lock l;
    l.fd_ = fd;
    return std::optional<cache_lock>(std::move(l));
  }
  cache_lock(cache_lock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  cache_lock& operator=(cache_lock&&) = delete;
  ~cache_lock() {
    if (fd_ >= 0) ::close(fd_);
  }

 private:
  cache_lock() = default;
  int fd_ = -1;
};

// Wakes the read-ahead thread; shared with the shard_bytes handed out, so
// that a release (which may free room) is an event it can wait on.
struct wake_core {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t wake = 0;
};

class mapped_shard final : public shard_bytes {
 public:
  mapped_shard(mapped_file m, std::shared_ptr<wake_core> core) : m_(std::move(m)), core_(std::move(core)) {}
  ~mapped_shard() override {
    if (!core_) return;
    std::lock_guard<std::mutex> lock(core_->mu);
    ++core_->wake;
    core_->cv.notify_all();
  }
  const uint8_t* data() const override { return m_.data(); }
  size_t size() const override { return m_.size(); }

 private:
  mapped_file m_;
  std::shared_ptr<wake_core> core_;
};

struct cache_entry {
  std::string name;
  uint64_t bytes = 0;
  timespec used{};  // mtime: get() touches a shard's file, so this is the last use on the node
};

bool older(const cache_entry& a, const cache_entry& b) {
  if (a.used.tv_sec != b.used.tv_sec) return a.used.tv_sec < b.used.tv_sec;
  if (a.used.tv_nsec != b.used.tv_nsec) return a.used.tv_nsec < b.used.tv_nsec;
  return a.name < b.name;
}

// A cached shard's file name: 16 hex digits, '-', more.
bool is_cache_file_name(const std::string& n) {
  return n.size() > 17 && n[16] == '-' && std::all_of(n.begin(), n.begin() + 16, [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

enum class fetch_outcome { done, no_room, stopped };

}  // namespace

struct shard_reader::impl {
  std::vector<shard_info> shards;
  shard_cache_options opt;
  std::string locks_dir;
  std::vector<bool> remote;
  std::vector<std::string> cache_name;  // remote shards: file name in the cache directory
  std::shared_ptr<wake_core> core = std::make_shared<wake_core>();
  std::atomic<bool> stopping{false};

  // Guarded by core->mu. No shard_bytes may be destroyed while it is held
  // (its destructor takes it): check weak pointers with expired().
  std::vector<std::shared_ptr<const shard_bytes>> local_maps;
  std::vector<std::weak_ptr<const shard_bytes>> held;
  std::vector<bool> busy;      // a get() or the read-ahead thread is on it in this process
  std::vector<bool> verified;  // digest checked by this reader
  std::vector<size_t> next;
  uint64_t next_generation = 0;
  std::set<size_t> done;  // of `next`: handled by the read-ahead thread
  bool idle = true, stop = false;
  uint64_t idle_wake = 0;  // core->wake when the thread last found nothing more to do
  shard_reader_stats st;

  std::mutex stores_mu;
  std::map<std::string, std::unique_ptr<object_store>> stores;
  std::thread thread;

  std::string cache_path(size_t i) const { return opt.cache_dir + "/" + cache_name[i]; }
  std::string lock_path(const std::string& file) const { return locks_dir + "/" + file + ".lock"; }

  error shard_error(size_t i, const std::string& what) const { return make_error("shard " + printable(shards[i].url) + ": " + what); }
  std::string says(size_t i) const { return shards[i].digest.empty() ? "the listing said " : "the index says "; }

  template <class F>
  void with_stats(F f) {
    std::lock_guard<std::mutex> lock(core->mu);
    f(st);
  }

  void note_usage(uint64_t used) {
    with_stats([&](shard_reader_stats& s) {
      s.cache_used_bytes = used;
      s.cache_peak_bytes = std::max(s.cache_peak_bytes, used);
    });
  }

  result<object_store*> store_for(size_t i) {
    const std::string location = split_url(shards[i].url).first;
    std::lock_guard<std::mutex> lock(stores_mu);
    auto it = stores.find(location);
    if (it != stores.end()) return it->second.get();
    auto s = open_object_store_readonly(location, opt.s3_endpoint);
    if (!s) return shard_error(i, s.message());
    return stores.emplace(location, std::move(s.value())).first->second.get();
  }

  bool cached_with_size(size_t i) const {
    struct stat sb {};
    return ::stat(cache_path(i).c_str(), &sb) == 0 && S_ISREG(sb.st_mode) && static_cast<uint64_t>(sb.st_size) == shards[i].bytes;
  }

  void touch(size_t i) const { (void)::utimensat(AT_FDCWD, cache_path(i).c_str(), nullptr, 0); }

  // The cache's files (cached shards and fetches in flight); drops temp
  // files whose fetcher died (its shard's lock is free, or is held by the
  // caller, who fetches `own` itself). Under the space lock.
  std::pair<std::vector<cache_entry>, uint64_t> scan(const std::string& own = "") const {
    std::vector<cache_entry> files;
    uint64_t used = 0;
    std::error_code ec;
    for (std::filesystem::directory_iterator it(opt.cache_dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.empty() || name[0] == '.') continue;
      const std::string path = opt.cache_dir + "/" + name;
      struct stat sb {};
      if (::lstat(path.c_str(), &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
      if (is_atomic_temp_name(name)) {
        const std::string owner = name.substr(0, name.rfind(".tmp."));
        auto l = owner == own ? result<std::optional<cache_lock>>(std::optional<cache_lock>()) : cache_lock::take(lock_path(owner), false);
        if (owner == own || (l && l.value())) {
          ::unlink(path.c_str());
          continue;
        }
        used += static_cast<uint64_t>(sb.st_size);
      } else if (is_cache_file_name(name)) {
        used += static_cast<uint64_t>(sb.st_size);
        files.push_back({name, static_cast<uint64_t>(sb.st_size), sb.st_mtim});
      }
    }
    return {std::move(files), used};
  }

  // Counts the cache's bytes again (after a file was dropped).
  void rescan() {
    auto space = cache_lock::take(locks_dir + "/" + space_lock_name, true);
    if (space) note_usage(scan().second);
  }

  // Makes room for shard i and creates its temp file at full size, so that
  // every process counts it from now on. urgent (get()): may evict shards of
  // the read-ahead hint and shards still held here (their mappings stay
  // valid), and waits for room that other processes' fetches hold; else
  // (read-ahead) evicts neither, and says no_room.
  result<std::pair<int, std::string>> reserve(size_t i, bool urgent, fetch_outcome& outcome) {
    const uint64_t need = shards[i].bytes;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(5);
    for (auto pause = std::chrono::milliseconds(5);; pause = std::min(pause * 2, std::chrono::milliseconds(200))) {
      {
        auto space = cache_lock::take(locks_dir + "/" + space_lock_name, true);
        if (!space) return shard_error(i, "data cache: " + space.message());
        auto [files, used] = scan(cache_name[i]);
        if (used + need > opt.cache_bytes) {
          std::set<std::string> in_next, in_use;
          {
            std::lock_guard<std::mutex> lock(core->mu);
            for (size_t k : next)
              if (remote[k]) in_next.insert(cache_name[k]);
            for (size_t k = 0; k < shards.size(); ++k)
              if (remote[k] && !held[k].expired()) in_use.insert(cache_name[k]);
          }
          std::sort(files.begin(), files.end(), older);
          for (int tier = 0; tier < (urgent ? 3 : 1) && used + need > opt.cache_bytes; ++tier)
            for (const auto& f : files) {
              if (used + need <= opt.cache_bytes) break;
              if (f.name == cache_name[i]) continue;
              const int t = in_use.count(f.name) ? 2 : in_next.count(f.name) ? 1 : 0;
              if (t != tier) continue;
              auto l = cache_lock::take(lock_path(f.name), false);
              if (!l || !l.value()) continue;  // being fetched, checked or mapped by someone
              if (::unlink((opt.cache_dir + "/" + f.name).c_str()) == 0) used -= f.bytes;
            }
        }
        if (used + need <= opt.cache_bytes) {
          static std::atomic<uint64_t> counter{0};
          const std::string tmp = cache_path(i) + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
          const int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
          if (fd < 0) return shard_error(i, "cannot create '" + tmp + "' in the data cache: " + os_reason(errno));
          int err = need == 0 ? 0 : ::fallocate(fd, 0, 0, static_cast<off_t>(need)) == 0 ? 0 : errno;
          if (err == EOPNOTSUPP || err == ENOSYS) err = ::ftruncate(fd, static_cast<off_t>(need)) == 0 ? 0 : errno;
          if (err) {
            ::close(fd);
            ::unlink(tmp.c_str());
            return shard_error(i,
                               "cannot make room for " + std::to_string(need) + " bytes in the data cache " + opt.cache_dir + ": " + os_reason(err));
          }
          note_usage(used + need);
          outcome = fetch_outcome::done;
          return std::make_pair(fd, tmp);
        }
        note_usage(used);
      }
      if (!urgent) {
        outcome = fetch_outcome::no_room;
        return std::make_pair(-1, std::string());
      }
      if (std::chrono::steady_clock::now() > deadline)
        return shard_error(i, "no room in the data cache " + opt.cache_dir + " (data.cache_bytes " + std::to_string(opt.cache_bytes) + ") for " +
                                  std::to_string(need) + " bytes after 5 minutes: other processes' fetches fill it; raise data.cache_bytes");
      std::this_thread::sleep_for(pause);  // other processes' fetches in flight hold the room: no event reaches us
    }
  }

  // Fetches shard i into the cache (the caller holds its lock): checks the
  // object's size, streams it into a reserved temp file while hashing,
  // compares the digest, renames it into place.
  result<fetch_outcome> fetch(size_t i, bool urgent) {
    const shard_info& s = shards[i];
    auto count_failed = [&](error e) {
      with_stats([](shard_reader_stats& x) { ++x.shards_failed; });
      return e;
    };
    auto store = store_for(i);
    if (!store) return count_failed(store.err());
    const std::string name = split_url(s.url).second;
    auto size = store.value()->size_of(name);
    if (!size) return count_failed(shard_error(i, size.message()));
    if (!size.value()) return count_failed(shard_error(i, "no such object (removed since the shards were listed?)"));
    if (*size.value() != s.bytes) return count_failed(shard_error(i, std::to_string(*size.value()) + " bytes, " + says(i) + std::to_string(s.bytes)));
    fetch_outcome outcome = fetch_outcome::done;
    auto reserved = reserve(i, urgent, outcome);
    if (!reserved) return count_failed(reserved.err());
    if (outcome != fetch_outcome::done) return outcome;
    const int fd = reserved->first;
    const std::string tmp = reserved->second;
    auto drop = [&] {
      ::close(fd);
      ::unlink(tmp.c_str());
      rescan();
    };
    std::vector<char> buf(static_cast<size_t>(std::min<uint64_t>(chunk_bytes, std::max<uint64_t>(s.bytes, 1))));
    hasher h;
    uint64_t at = 0;
    while (at < s.bytes) {
      if (!urgent && stopping.load()) {
        drop();
        return fetch_outcome::stopped;
      }
      auto n = store.value()->read(name, at, buf.data(), std::min<uint64_t>(buf.size(), s.bytes - at));
      if (!n) {
        drop();
        return count_failed(shard_error(i, n.message()));
      }
      with_stats([&](shard_reader_stats& x) { x.bytes_read_s3 += n.value(); });
      if (n.value() == 0) {
        drop();
        return count_failed(shard_error(i, "the object ended after " + std::to_string(at) + " bytes, " + says(i) + std::to_string(s.bytes)));
      }
      for (uint64_t w = 0; w < n.value();) {
        const ssize_t k = ::pwrite(fd, buf.data() + w, n.value() - w, static_cast<off_t>(at + w));
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
          const int err = k < 0 ? errno : EIO;
          drop();
          return count_failed(shard_error(i, "cannot write '" + tmp + "' in the data cache: " + os_reason(err)));
        }
        w += static_cast<uint64_t>(k);
      }
      h.update(buf.data(), n.value());
      at += n.value();
    }
    const std::string got = digest_of(at, h.digest());
    if (!s.digest.empty() && got != s.digest) {
      drop();
      return count_failed(shard_error(
          i, "its bytes hash to " + got + ", the index says " + s.digest + " (changed since `dtactor data index`: restore it, or index again)"));
    }
    if (::fdatasync(fd) != 0 || ::close(fd) != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      rescan();
      return count_failed(shard_error(i, "cannot write '" + tmp + "' in the data cache: " + os_reason(err)));
    }
    int rename_err = 0;
    {
      // Under the space lock: a directory listing that runs beside a rename
      // may see neither name (or both), and the bound rests on every count.
      auto space = cache_lock::take(locks_dir + "/" + space_lock_name, true);
      if (!space) {
        ::unlink(tmp.c_str());
        return count_failed(shard_error(i, "data cache: " + space.message()));
      }
      if (::rename(tmp.c_str(), cache_path(i).c_str()) != 0) rename_err = errno;
    }
    if (rename_err) {
      ::unlink(tmp.c_str());
      rescan();
      return count_failed(shard_error(i, "cannot rename '" + tmp + "' in the data cache: " + os_reason(rename_err)));
    }
    with_stats([&](shard_reader_stats& x) {
      ++x.shards_verified;
      verified[i] = true;
    });
    return fetch_outcome::done;
  }

  // The cached file of shard i, mapped, if it is there and right (the
  // caller holds its lock). A file of the wrong size, or one whose digest
  // this process finds wrong (once per shard), is removed: stale, from
  // another version of the data.
  result<std::optional<std::shared_ptr<const shard_bytes>>> map_cached(size_t i) {
    using none = std::optional<std::shared_ptr<const shard_bytes>>;
    const std::string path = cache_path(i);
    struct stat sb {};
    if (::stat(path.c_str(), &sb) != 0) return none();
    if (!S_ISREG(sb.st_mode) || static_cast<uint64_t>(sb.st_size) != shards[i].bytes) {
      ::unlink(path.c_str());
      rescan();
      return none();
    }
    auto m = mapped_file::open(path);
    if (!m) return shard_error(i, "the data cache: " + m.message());
    bool check = false;
    {
      std::lock_guard<std::mutex> lock(core->mu);
      check = !shards[i].digest.empty() && !verified[i];
    }
    if (check) {
      if (digest_of(m->size(), hash64(m->data(), m->size())) != shards[i].digest) {
        ::unlink(path.c_str());
        rescan();
        return none();
      }
      std::lock_guard<std::mutex> lock(core->mu);
      verified[i] = true;
    }
    touch(i);
    return none(std::make_shared<mapped_shard>(std::move(m.value()), core));
  }

  // get() of a remote shard whose `busy` this thread holds: (bytes, hit).
  result<std::pair<std::shared_ptr<const shard_bytes>, bool>> load(size_t i, bool waited) {
    const bool present_before = !waited && cached_with_size(i);
    auto lock = cache_lock::take(lock_path(cache_name[i]), true);
    if (!lock) return shard_error(i, "data cache: " + lock.message());
    auto have = map_cached(i);
    if (!have) return have.err();
    if (have.value()) return std::make_pair(*have.value(), present_before);
    auto f = fetch(i, true);
    if (!f) return f.err();
    auto after = map_cached(i);
    if (!after) return after.err();
    if (!after.value()) return shard_error(i, "the data cache lost it right after the fetch");
    return std::make_pair(*after.value(), false);
  }

  // The read-ahead thread's part for shard j.
  fetch_outcome prefetch(size_t j) {
    if (cached_with_size(j)) {
      touch(j);
      return fetch_outcome::done;
    }
    auto lock = cache_lock::take(lock_path(cache_name[j]), false);
    if (!lock || !lock.value()) return fetch_outcome::done;  // another process is at it
    if (cached_with_size(j)) return fetch_outcome::done;
    auto f = fetch(j, false);
    return f ? f.value() : fetch_outcome::done;  // a failure is counted; get() tries again and says why
  }

  // Nothing more to do until an event after `seen` (the wake count the
  // decision was made at).
  void go_idle(std::unique_lock<std::mutex>& lk, uint64_t seen) {
    idle = true;
    idle_wake = seen;
    core->cv.notify_all();
    core->cv.wait(lk, [&] { return stop || core->wake != seen; });
  }

  void run() {
    std::unique_lock<std::mutex> lk(core->mu);
    while (!stop) {
      std::optional<size_t> pick;
      uint64_t depth = 0;
      for (size_t j : next) {
        if (!remote[j] || done.count(j)) continue;
        ++depth;
        if (!pick && !busy[j]) pick = j;
      }
      st.read_ahead_depth = depth;
      const uint64_t seen = core->wake;
      if (!pick) {
        go_idle(lk, seen);
        continue;
      }
      idle = false;
      const size_t j = *pick;
      const uint64_t generation = next_generation;
      busy[j] = true;
      lk.unlock();
      const fetch_outcome o = prefetch(j);
      lk.lock();
      busy[j] = false;
      core->cv.notify_all();
      if (o == fetch_outcome::no_room) {
        go_idle(lk, seen);  // room comes with a new hint, a get() or a released shard
        continue;
      }
      if (generation == next_generation) done.insert(j);
    }
    st.read_ahead_depth = 0;
    idle = true;
    core->cv.notify_all();
  }
};

namespace {
struct reader_registry {
  std::mutex mu;
  std::set<const shard_reader*> live;
  shard_reader_stats gone;  // counters of readers already destroyed
};
reader_registry& registry() {
  static reader_registry r;
  return r;
}
// Adds b's counters (and the larger peak) to a; gauges are the caller's.
void add_counters(shard_reader_stats& a, const shard_reader_stats& b) {
  a.bytes_read_local += b.bytes_read_local;
  a.bytes_read_s3 += b.bytes_read_s3;
  a.cache_hits += b.cache_hits;
  a.cache_misses += b.cache_misses;
  a.shards_verified += b.shards_verified;
  a.shards_failed += b.shards_failed;
  a.cache_peak_bytes = std::max(a.cache_peak_bytes, b.cache_peak_bytes);
}
}  // namespace

result<std::unique_ptr<shard_reader>> shard_reader::open(std::vector<shard_info> shards, shard_cache_options options) {
  auto d = std::make_unique<impl>();
  const size_t n = shards.size();
  d->remote.resize(n);
  d->cache_name.resize(n);
  uint64_t largest = 0, second = 0;
  bool any_remote = false;
  for (size_t i = 0; i < n; ++i) {
    if (!is_s3(shards[i].url)) continue;
    any_remote = true;
    d->remote[i] = true;
    std::string base = split_url(shards[i].url).second.substr(0, 150);
    d->cache_name[i] = hex64(hash64(shards[i].url.data(), shards[i].url.size())) + "-" + base;
    if (shards[i].bytes > largest) {
      second = largest;
      largest = shards[i].bytes;
    } else if (shards[i].bytes > second) {
      second = shards[i].bytes;
    }
  }
  if (any_remote) {
    if (options.cache_bytes < largest + second)
      return make_error("data.cache_bytes is " + std::to_string(options.cache_bytes) + "; it must hold the two largest remote shards (" +
                        std::to_string(largest) + " + " + std::to_string(second) + " = " + std::to_string(largest + second) +
                        " bytes: one being read while the next is fetched)");
    if (options.cache_dir.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      options.cache_dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/dtactor-data-cache";
    }
    options.cache_dir = absolute_location(options.cache_dir);
    while (options.cache_dir.size() > 1 && options.cache_dir.back() == '/') options.cache_dir.pop_back();
    if (auto st = ensure_writable_dir(options.cache_dir); !st) return make_error("data cache: " + st.message());
    d->locks_dir = options.cache_dir + "/" + locks_subdir;
    if (auto st = ensure_writable_dir(d->locks_dir); !st) return make_error("data cache: " + st.message());
  }
  d->shards = std::move(shards);
  d->opt = std::move(options);
  d->local_maps.resize(n);
  d->held.resize(n);
  d->busy.resize(n);
  d->verified.resize(n);
  if (any_remote) {
    auto space = cache_lock::take(d->locks_dir + "/" + space_lock_name, true);
    if (!space) return make_error("data cache: " + space.message());
    const uint64_t used = d->scan().second;
    d->st.cache_used_bytes = d->st.cache_peak_bytes = used;
    d->idle = false;
    d->thread = std::thread([p = d.get()] { p->run(); });
  }
  std::unique_ptr<shard_reader> r(new shard_reader());
  r->impl_ = std::move(d);
  {
    std::lock_guard<std::mutex> lock(registry().mu);
    registry().live.insert(r.get());
  }
  return r;
}

shard_reader::~shard_reader() {
  if (!impl_) return;
  {
    // Its counters stay in the process's sums; its gauges go.
    std::lock_guard<std::mutex> lock(registry().mu);
    registry().live.erase(this);
    add_counters(registry().gone, stats());
  }
  impl_->stopping = true;
  {
    std::lock_guard<std::mutex> lock(impl_->core->mu);
    impl_->stop = true;
    ++impl_->core->wake;
    impl_->core->cv.notify_all();
  }
  if (impl_->thread.joinable()) impl_->thread.join();
}

const std::vector<shard_info>& shard_reader::shards() const { return impl_->shards; }

result<std::shared_ptr<const shard_bytes>> shard_reader::get(size_t i) {
  impl& d = *impl_;
  if (i >= d.shards.size()) return make_error("shard " + std::to_string(i) + " asked for; there are " + std::to_string(d.shards.size()));
  std::unique_lock<std::mutex> lk(d.core->mu);
  if (!d.remote[i]) {
    if (!d.local_maps[i]) {
      auto m = mapped_file::open(d.shards[i].url);
      if (!m) return make_error("shard " + m.message() + " (changed since the shards were listed?)");
      if (m->size() != d.shards[i].bytes)
        return d.shard_error(i, std::to_string(m->size()) + " bytes, " + d.says(i) + std::to_string(d.shards[i].bytes));
      d.st.bytes_read_local += m->size();
      d.local_maps[i] = std::make_shared<mapped_shard>(std::move(m.value()), nullptr);
    }
    ++d.st.cache_hits;
    return d.local_maps[i];
  }
  bool waited = false;
  for (;;) {
    if (!d.held[i].expired())
      if (auto h = d.held[i].lock()) {
        ++d.st.cache_hits;
        lk.unlock();
        d.touch(i);
        return std::shared_ptr<const shard_bytes>(std::move(h));
      }
    if (!d.busy[i]) break;
    waited = true;
    d.core->cv.wait(lk);
  }
  d.busy[i] = true;
  lk.unlock();
  auto r = d.load(i, waited);
  lk.lock();
  d.busy[i] = false;
  ++d.core->wake;
  d.core->cv.notify_all();
  if (!r) return r.err();
  d.held[i] = r->first;
  if (r->second)
    ++d.st.cache_hits;
  else
    ++d.st.cache_misses;
  return r->first;
}

void shard_reader::read_ahead(std::vector<size_t> next) {
  impl& d = *impl_;
  next.erase(std::remove_if(next.begin(), next.end(), [&](size_t i) { return i >= d.shards.size(); }), next.end());
  std::lock_guard<std::mutex> lock(d.core->mu);
  uint64_t depth = 0;
  for (size_t i : next) depth += d.remote[i] ? 1 : 0;
  d.next = std::move(next);
  ++d.next_generation;
  d.done.clear();
  if (d.thread.joinable()) {
    d.idle = false;
    d.st.read_ahead_depth = depth;
  }
  ++d.core->wake;
  d.core->cv.notify_all();
}

bool shard_reader::wait_read_ahead(std::chrono::milliseconds timeout) {
  impl& d = *impl_;
  std::unique_lock<std::mutex> lk(d.core->mu);
  if (!d.thread.joinable()) return true;
  // Idle, and no event since it decided so (a release may have made room).
  return d.core->cv.wait_for(lk, timeout, [&] { return d.stop || (d.idle && d.idle_wake == d.core->wake); });
}

std::optional<shard_reader_stats> process_shard_reader_stats() {
  std::lock_guard<std::mutex> lock(registry().mu);
  if (registry().live.empty() && registry().gone.cache_hits + registry().gone.cache_misses == 0) return std::nullopt;
  shard_reader_stats sum = registry().gone;
  for (const shard_reader* r : registry().live) {
    const auto s = r->stats();
    add_counters(sum, s);
    sum.read_ahead_depth += s.read_ahead_depth;
    sum.cache_used_bytes = std::max(sum.cache_used_bytes, s.cache_used_bytes);  // readers of one process share one directory
  }
  return sum;
}

shard_reader_stats shard_reader::stats() const {
  std::lock_guard<std::mutex> lock(impl_->core->mu);
  return impl_->st;
}

}  // namespace dtactor
