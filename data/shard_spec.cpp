// Shard specs (data/data_shards.hpp, docs/data.md): a glob, a {A..B}
// range or a list, local or s3://, resolved into shards through their
// stores' listings and checked against the shard index beside them.
#include <fnmatch.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <tuple>

#include "base/hash.hpp"
#include "data/data_shards.hpp"
#include "data/shard_names.hpp"
#include "storage/fs.hpp"
#include "storage/object_store.hpp"

namespace dtactor {

namespace shard_detail {

std::string trim(const std::string& s) {
  const auto a = s.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return {};
  const auto b = s.find_last_not_of(" \t\r\n");
  return s.substr(a, b - a + 1);
}

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

std::pair<std::string, std::string> split_url(const std::string& url) {
  const auto slash = url.rfind('/');
  if (slash == std::string::npos) return {".", url};
  std::string loc = url.substr(0, slash);
  if (loc.empty()) loc = "/";
  return {loc, url.substr(slash + 1)};
}

std::string digest_of(uint64_t bytes, uint64_t xxh3) { return std::to_string(bytes) + ":" + hex64(xxh3); }

namespace {

constexpr uint64_t max_range_names = 1'000'000;  // what {A..B} ranges may expand to, all together

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

}  // namespace

error resolver::fail(const std::string& what) const { return make_error("data '" + printable(spec_) + "': " + what); }

result<object_store*> resolver::store_at(const std::string& location) {
  auto it = stores_.find(location);
  if (it != stores_.end()) return it->second.get();
  auto s = open_object_store_readonly(location, endpoint_);
  if (!s) return fail(s.message());
  return stores_.emplace(location, std::move(s.value())).first->second.get();
}

result<const std::vector<object_info>*> resolver::listing(const std::string& location) {
  auto it = listings_.find(location);
  if (it != listings_.end()) return &it->second;
  auto store = store_at(location);
  if (!store) return store.err();
  auto l = store.value()->list();
  if (!l) return fail(l.message());
  return &listings_.emplace(location, std::move(l.value())).first->second;
}

result<std::vector<shard_info>> resolver::resolve(bool use_index) {
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

status resolver::add(const std::string& pattern, bool from_range, std::vector<shard_info>& out) {
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
      return fail(std::string(from_range ? "a name of its range matches nothing: " : "nothing matches ") + "'" + printable(join_url(location, pat)) +
                  "'");
    return {};
  }
  auto size = store.value()->size_of(pat);
  if (!size) return fail(size.message());
  if (!size.value()) return fail("'" + printable(join_url(location, pat)) + "' " + (from_range ? "of its range " : "") + "does not exist");
  out.push_back({join_url(location, pat), *size.value(), ""});
  return {};
}

status resolver::apply_indexes(std::vector<shard_info>& shards) {
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

}  // namespace shard_detail

using namespace shard_detail;

bool names_shards(const std::string& spec) {
  const std::string s = trim(spec);
  if (is_s3(s) || s.find(',') != std::string::npos) return true;
  if (has_glob(split_url(s).second)) return true;
  const auto open = s.find('{');
  return open != std::string::npos && s.find("..", open) != std::string::npos && s.find('}', open) != std::string::npos;
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

}  // namespace dtactor
