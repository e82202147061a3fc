// The shard index (data/data_shards.hpp, docs/data.md): dtactor-shards.json
// beside the shards, parsed (outside bytes: fuzz/shard_index.cpp) and
// written by `dtactor data index`.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "base/hash.hpp"
#include "data/data_shards.hpp"
#include "data/shard_names.hpp"
#include "data/webdataset.hpp"
#include "storage/fs.hpp"
#include "storage/object_store.hpp"

namespace dtactor {

using namespace shard_detail;

namespace {

using index_entries = std::map<std::string, shard_index_entry>;

constexpr size_t max_index_depth = 8;  // nesting a real index never passes

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

// Reads shard `s` of `objects` once, through `buf`: its size, digest and,
// when its kind has them, its records. Errors name the spec (through `r`).
result<shard_index_entry> index_shard(resolver& r, object_store& objects, const shard_info& s, std::vector<char>& buf) {
  const std::string name = split_url(s.url).second;
  hasher h;
  auto counter = record_counter::for_name(name, "shard " + printable(s.url));
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
  if (at != s.bytes)
    return r.fail("shard " + printable(s.url) + " changed while it was indexed (" + std::to_string(s.bytes) + " bytes listed, " + std::to_string(at) +
                  " read)");
  int64_t records = -1;
  if (counter) {
    auto c = counter->finish(at);
    if (!c) return r.fail(c.message());
    records = c.value();
  }
  return shard_index_entry{at, digest_of(at, h.digest()), records};
}

// Adds to `entries` what an older index of `location` says of other files
// still there with the size it gives. An unreadable old index adds nothing.
void keep_old_entries(resolver& r, object_store& objects, const std::string& location, index_entries& entries) {
  auto old_size = objects.size_of(shard_index_name);
  if (!old_size || !old_size.value()) return;
  auto text = objects.get(shard_index_name, object_store::max_small_object_bytes);
  if (!text) return;
  auto old = parse_shard_index(text.value(), join_url(location, shard_index_name));
  if (!old) return;
  auto listed = r.listing(location);
  if (!listed) return;
  for (const auto& o : *listed.value()) {
    auto e = old->find(o.name);
    if (e != old->end() && !entries.count(o.name) && e->second.bytes == o.size) entries.emplace(o.name, e->second);
  }
}

// The index file's text: one entry a line, by name. Error: a name JSON
// cannot hold.
result<std::string> render_index(resolver& r, const std::string& location, const index_entries& entries) {
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
  return text;
}

// Indexes the shards of one location and writes its index there.
status index_location(resolver& r, const std::string& location, const std::vector<const shard_info*>& group, std::vector<char>& buf,
                      const shard_index_written& on_index) {
  auto store = r.store_at(location);
  if (!store) return store.err();
  object_store& objects = *store.value();
  index_entries entries;
  uint64_t group_bytes = 0;
  for (const shard_info* s : group) {
    auto e = index_shard(r, objects, *s, buf);
    if (!e) return e.err();
    group_bytes += e->bytes;
    entries[split_url(s->url).second] = std::move(e.value());
  }
  keep_old_entries(r, objects, location, entries);
  auto text = render_index(r, location, entries);
  if (!text) return text.err();
  const std::string where = join_url(location, shard_index_name);
  status written = is_s3(location) ? objects.put(shard_index_name, text.value()) : write_file_atomic(where, {text.value()});
  if (!written) return r.fail("cannot write the index: " + written.message());
  if (on_index) on_index(where, group.size(), group_bytes);
  return {};
}

}  // namespace

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

result<size_t> write_shard_index(const std::string& spec, const std::string& s3_endpoint, const shard_index_written& on_index) {
  resolver r(spec, s3_endpoint);
  auto shards = r.resolve(false);
  if (!shards) return shards.err();
  std::map<std::string, std::vector<const shard_info*>> by_location;
  for (const auto& s : shards.value()) by_location[split_url(s.url).first].push_back(&s);
  std::vector<char> buf(chunk_bytes);
  size_t indexed = 0;
  for (const auto& [location, group] : by_location) {
    if (auto st = index_location(r, location, group, buf, on_index); !st) return st.err();
    indexed += group.size();
  }
  return indexed;
}

}  // namespace dtactor
