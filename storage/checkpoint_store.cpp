#include "storage/checkpoint_store.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <set>
#include <string_view>

#include "base/hash.hpp"
#include "base/job_key.hpp"

namespace dtactor {

namespace {

constexpr std::string_view magic = "DTACMAN2";
constexpr uint64_t prefix_size = 12;  // magic + u32 meta length
constexpr uint64_t trailer_size = 8;  // u64 meta checksum
constexpr uint64_t chunk_bytes = 8ull << 20;
// A signed manifest ends in this tag and the HMAC-SHA256, under the job's
// MAC key, of every byte before the tag.
constexpr std::string_view mac_tag = "DTACMAC1";
constexpr uint64_t mac_bytes = 32;
constexpr uint64_t mac_trailer_size = 8 + mac_bytes;

std::string& mac_key_storage() {
  static std::string key;
  return key;
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// An error of a checkpoint's own bytes (not of the store's reachability): a
// rank that meets it refuses the checkpoint for good.
error corrupt(error e) {
  e.code = errc::corrupt_checkpoint;
  return e;
}

uint64_t get_le(std::string_view in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(in[at + i])) << (8 * i);
  return v;
}

// Digits [b, e) of s as a number; nullopt when not all digits or empty.
std::optional<uint64_t> digits(std::string_view s) {
  if (s.empty() || s.size() > 18) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

// The step of a manifest name exactly as manifest_name() writes it.
std::optional<int64_t> manifest_step(std::string_view name) {
  constexpr std::string_view pre = "ckpt-", suf = ".manifest";
  if (name.size() <= pre.size() + suf.size() || name.substr(0, pre.size()) != pre ||
      name.substr(name.size() - suf.size()) != suf)
    return std::nullopt;
  auto d = digits(name.substr(pre.size(), name.size() - pre.size() - suf.size()));
  if (!d || manifest_name(static_cast<int64_t>(*d)) != name) return std::nullopt;
  return static_cast<int64_t>(*d);
}

struct part_id {
  int64_t step;
  uint64_t generation;
};

// (step, generation) of a part name exactly as part_name() writes it, any
// index (a rank's second and later ranges) included.
std::optional<part_id> parse_part_name(std::string_view name) {
  constexpr std::string_view pre = "ckpt-", suf = ".part";
  if (name.size() <= pre.size() + suf.size() || name.substr(0, pre.size()) != pre ||
      name.substr(name.size() - suf.size()) != suf)
    return std::nullopt;
  std::string_view mid = name.substr(pre.size(), name.size() - pre.size() - suf.size());  // 000000012.g3.r0-of-2 or ...-of-2.1
  const size_t g = mid.find(".g"), r = mid.find(".r"), of = mid.find("-of-");
  if (g == std::string_view::npos || r == std::string_view::npos || of == std::string_view::npos || !(g < r && r < of)) return std::nullopt;
  const size_t k = mid.find('.', of + 4);  // ".<index>", absent for index 0
  auto step = digits(mid.substr(0, g));
  auto gen = digits(mid.substr(g + 2, r - g - 2));
  auto rank = digits(mid.substr(r + 2, of - r - 2));
  auto world = digits(mid.substr(of + 4, k == std::string_view::npos ? std::string_view::npos : k - of - 4));
  auto index = k == std::string_view::npos ? std::optional<uint64_t>(0) : digits(mid.substr(k + 1));
  if (!step || !gen || !rank || !world || !index) return std::nullopt;
  if (*rank > static_cast<uint64_t>(std::numeric_limits<int>::max()) || *world > static_cast<uint64_t>(std::numeric_limits<int>::max()) ||
      *index > static_cast<uint64_t>(std::numeric_limits<int>::max()))
    return std::nullopt;
  if (part_name(static_cast<int64_t>(*step), *gen, static_cast<int>(*rank), static_cast<int>(*world), static_cast<int>(*index)) != name)
    return std::nullopt;
  return part_id{static_cast<int64_t>(*step), *gen};
}

std::string encode_manifest(const pb::checkpoint_meta& meta) {
  std::string body;
  meta.SerializeToString(&body);
  std::string out;
  out.reserve(prefix_size + body.size() + trailer_size);
  out.append(magic);
  put_le(out, body.size(), 4);
  out.append(body);
  put_le(out, hash64(body.data(), body.size()), 8);
  if (const auto& key = mac_key_storage(); !key.empty()) {
    const std::string mac = hmac_sha256(key, out);
    out.append(mac_tag);
    out.append(mac);
  }
  return out;
}

// `key`: the MAC key to check against (empty: none, a MAC is not checked);
// `key_refused` is set when the manifest is refused for the key alone.
result<pb::checkpoint_meta> decode_manifest(std::string_view bytes, const std::string& key, bool* key_refused = nullptr) {
  if (key_refused) *key_refused = false;
  if (bytes.size() < prefix_size || bytes.substr(0, magic.size()) != magic) {
    if (bytes.substr(0, 8) == "DTACKPT1") return make_error("a checkpoint of the old single-file format (before format 2), which this dtactor does not read");
    return make_error("not a dtactor checkpoint manifest (bad magic)");
  }
  const uint64_t len = get_le(bytes, magic.size(), 4);
  const uint64_t unsigned_size = prefix_size + len + trailer_size;
  const bool has_mac = bytes.size() == unsigned_size + mac_trailer_size && bytes.substr(unsigned_size, mac_tag.size()) == mac_tag;
  if (!key.empty()) {
    const bool mac_ok = has_mac && equal_constant_time(hmac_sha256(key, std::string(bytes.substr(0, unsigned_size))),
                                                       std::string(bytes.substr(unsigned_size + mac_tag.size(), mac_bytes)));
    if (!mac_ok) {
      // A manifest that is whole by its own checksum is another key's (or an
      // unsigned one): refused for the key alone. One that is not whole is
      // corrupt, reported as such.
      if (auto plain = decode_manifest(bytes, ""); !plain) return plain.err();
      if (key_refused) *key_refused = true;
      if (!has_mac) return make_error("manifest is not signed with this job's key (no MAC): refused; was it written by another job, or planted?");
      return make_error("manifest MAC does not match this job's key: refused (another job's checkpoint, or tampered with)");
    }
  }
  // Without a key a signed manifest reads as an unsigned one (its MAC unchecked).
  if (has_mac) bytes = bytes.substr(0, unsigned_size);
  if (bytes.size() != prefix_size + len + trailer_size)
    return make_error("manifest truncated or with trailing data: expected " + std::to_string(prefix_size + len + trailer_size) + " bytes, has " +
                      std::to_string(bytes.size()));
  std::string_view body = bytes.substr(prefix_size, len);
  if (hash64(body.data(), body.size()) != get_le(bytes, prefix_size + len, 8)) return make_error("manifest checksum mismatch");
  pb::checkpoint_meta meta;
  if (!meta.ParseFromArray(body.data(), static_cast<int>(body.size()))) return make_error("manifest does not parse");
  return meta;
}

}  // namespace

void set_checkpoint_mac_key(std::string key) { mac_key_storage() = std::move(key); }
bool checkpoint_mac_enabled() { return !mac_key_storage().empty(); }

std::string manifest_name(int64_t step) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "ckpt-%09lld.manifest", static_cast<long long>(step));
  return buf;
}

std::string part_name(int64_t step, uint64_t generation, int rank, int world, int index) {
  char buf[112];
  if (index == 0)
    std::snprintf(buf, sizeof buf, "ckpt-%09lld.g%llu.r%d-of-%d.part", static_cast<long long>(step), static_cast<unsigned long long>(generation),
                  rank, world);
  else
    std::snprintf(buf, sizeof buf, "ckpt-%09lld.g%llu.r%d-of-%d.%d.part", static_cast<long long>(step), static_cast<unsigned long long>(generation),
                  rank, world, index);
  return buf;
}

int dtype_size(const std::string& d) {
  if (d == "float32" || d == "int32") return 4;
  if (d == "float64" || d == "int64") return 8;
  if (d == "float16" || d == "bfloat16" || d == "int16") return 2;
  if (d == "uint8" || d == "int8" || d == "bool") return 1;
  return 0;
}

namespace {
// Stores `size` bytes as `name`, a piece of at most `piece` bytes at a time:
// next(at, n) gives bytes [at, at + n) of the part (valid until the next
// call), hashed and written as they come.
result<pb::checkpoint_part> write_pieces(object_store& store, const std::string& name, uint64_t offset, uint64_t size, uint64_t piece,
                                         const std::function<const char*(uint64_t at, uint64_t n)>& next) {
  auto w = store.create(name);
  if (!w) return w.err();
  hasher h;
  for (uint64_t at = 0; at < size; at += piece) {
    const uint64_t n = std::min<uint64_t>(piece, size - at);
    const char* bytes = next(at, n);
    h.update(bytes, n);
    if (auto st = w.value()->write(bytes, n); !st) return st.err();
  }
  if (auto st = w.value()->commit(); !st) return st.err();
  pb::checkpoint_part p;
  p.set_name(name);
  p.set_offset(offset);
  p.set_size(size);
  p.set_xxh3(h.digest());
  return p;
}
}  // namespace

result<pb::checkpoint_part> write_part(object_store& store, const std::string& name, uint64_t offset, const char* data, uint64_t size) {
  return write_pieces(store, name, offset, size, chunk_bytes, [data](uint64_t at, uint64_t) { return data + at; });
}

result<pb::checkpoint_part> write_part(object_store& store, const std::string& name, uint64_t offset, uint64_t size,
                                       const std::function<void(uint64_t at, uint64_t n, char* dst)>& fill, char* scratch, uint64_t scratch_bytes) {
  if (scratch_bytes == 0 && size > 0) return make_error("writing part '" + name + "': no room to stage it in");
  return write_pieces(store, name, offset, size, scratch_bytes, [&](uint64_t at, uint64_t n) -> const char* {
    fill(at, n, scratch);
    return scratch;
  });
}

status check_manifest(const pb::checkpoint_meta& meta) {
  if (meta.format_version() != checkpoint_format_version)
    return make_error("unsupported checkpoint format version " + std::to_string(meta.format_version()) + " (this build reads " +
                      std::to_string(checkpoint_format_version) + ")");
  if (meta.step() < 0) return make_error("negative step " + std::to_string(meta.step()));
  uint64_t at = 0;
  std::set<std::string> names;
  for (const auto& p : meta.parts()) {
    if (p.name().empty() || p.name().find('/') != std::string::npos) return make_error("a part has a bad name '" + p.name() + "'");
    if (!names.insert(p.name()).second) return make_error("part '" + p.name() + "' is listed twice");
    if (p.offset() != at) return make_error("part '" + p.name() + "' starts at byte " + std::to_string(p.offset()) + ", expected " + std::to_string(at));
    if (p.size() > std::numeric_limits<uint64_t>::max() - at) return make_error("part '" + p.name() + "' has an impossible size");
    at += p.size();
  }
  if (at != meta.state_bytes())
    return make_error("parts cover " + std::to_string(at) + " bytes of a " + std::to_string(meta.state_bytes()) + "-byte state");
  std::set<std::string> tnames;
  for (const auto& t : meta.tensors()) {
    if (!tnames.insert(t.name()).second) return make_error("tensor '" + t.name() + "' is listed twice");
    const int es = dtype_size(t.dtype());
    if (es == 0) return make_error("tensor '" + t.name() + "' has unknown dtype '" + t.dtype() + "'");
    uint64_t numel = 1;
    for (int64_t d : t.shape()) {
      if (d < 0 || (d > 0 && numel > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d)))
        return make_error("tensor '" + t.name() + "' has an impossible shape");
      numel *= static_cast<uint64_t>(d);
    }
    if (numel > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(es) || numel * static_cast<uint64_t>(es) != t.size())
      return make_error("tensor '" + t.name() + "' is " + std::to_string(t.size()) + " bytes, its shape and dtype say otherwise");
    if (t.offset() > meta.state_bytes() || t.size() > meta.state_bytes() - t.offset())
      return make_error("tensor '" + t.name() + "' lies outside the state");
  }
  return {};
}

// -- the store -----------------------------------------------------------------

result<checkpoint_store> checkpoint_store::open(const std::string& location, checkpoint_policy policy, fs_env& env,
                                                const std::string& s3_endpoint) {
  if (policy.keep_last < 1)
    return make_error("checkpoint.keep_last must be at least 1 (got " + std::to_string(policy.keep_last) + ")");
  auto objects = open_object_store(location, env, s3_endpoint);
  if (!objects) {
    if (location.rfind("s3://", 0) == 0) return make_error("checkpoint store: " + objects.message());
    return make_error("checkpoint " + objects.message() + " (set checkpoint.dir to a writable directory)");
  }
  checkpoint_store store(std::shared_ptr<object_store>(std::move(objects.value())), std::move(policy));
  store.objects().sweep_stale_writes();
  int64_t newest = -1;
  for (const auto& s : store.scan())
    if (s.meta) newest = std::max(newest, s.step);
  if (newest >= 0) store.sweep_orphans(newest);
  return store;
}

result<checkpoint_store> checkpoint_store::open_readonly(const std::string& location, const std::string& s3_endpoint) {
  auto objects = open_object_store_readonly(location, s3_endpoint);
  if (!objects) return objects.err();
  return checkpoint_store(std::shared_ptr<object_store>(std::move(objects.value())), checkpoint_policy{});
}

checkpoint_store checkpoint_store::over(std::shared_ptr<object_store> objects, checkpoint_policy policy) {
  return checkpoint_store(std::move(objects), std::move(policy));
}

std::vector<checkpoint_store::scanned> checkpoint_store::scan() {
  std::vector<scanned> out;
  auto all = objects_->list();
  if (!all) return out;
  for (const auto& o : *all) {
    auto step = manifest_step(o.name);
    if (!step) continue;
    scanned s{o.name, *step, std::nullopt, false, {}};
    if (auto m = read_manifest(o.name, &s.key_refused); m) {
      s.meta = std::move(m.value());
    } else if (s.key_refused) {
      // Not ours to use, nor to delete: its parts stay referenced.
      if (auto bytes = objects_->get(o.name))
        if (auto other = decode_manifest(bytes.value(), ""))
          for (const auto& p : other->parts()) s.foreign_parts.push_back(p.name());
    }
    out.push_back(std::move(s));
  }
  std::sort(out.begin(), out.end(), [](const scanned& a, const scanned& b) { return a.step < b.step; });
  return out;
}

result<pb::checkpoint_meta> checkpoint_store::read_manifest(const std::string& name, bool* key_refused) {
  auto bytes = objects_->get(name);
  if (!bytes) {
    // Gone, or larger than a manifest can be, is the checkpoint's fault;
    // an error reaching the store is not.
    auto size = objects_->size_of(name);
    if (size && (!size.value() || *size.value() > object_store::max_small_object_bytes)) return corrupt(bytes.err());
    return bytes.err();
  }
  auto meta = decode_manifest(bytes.value(), mac_key_storage(), key_refused);
  if (!meta) return corrupt(meta.err());
  if (auto st = check_manifest(meta.value()); !st) return corrupt(st.err());
  if (auto step = manifest_step(name); step && *step != meta->step())
    return corrupt(make_error("name says step " + std::to_string(*step) + " but the manifest says step " + std::to_string(meta->step())));
  return meta;
}

status checkpoint_store::verify(const pb::checkpoint_meta& meta, bool checksums) {
  for (const auto& p : meta.parts()) {
    auto size = objects_->size_of(p.name());
    if (!size) return size.err();
    if (!size.value())
      return corrupt(make_error("part '" + p.name() + "'" + (p.node_id().empty() ? "" : " (written on node '" + p.node_id() + "')") + " is missing"));
    if (*size.value() != p.size())
      return corrupt(make_error("part '" + p.name() + "' is " + std::to_string(*size.value()) + " bytes, the manifest says " + std::to_string(p.size())));
  }
  if (!checksums) return {};
  return read_stream(meta, [](uint64_t, const char*, size_t) { return status{}; });
}

status checkpoint_store::read_stream(const pb::checkpoint_meta& meta, const std::function<status(uint64_t, const char*, size_t)>& fn,
                                     const std::function<bool(uint64_t, uint64_t)>& wanted) {
  std::string buf(static_cast<size_t>(std::min<uint64_t>(chunk_bytes, std::max<uint64_t>(1, meta.state_bytes()))), '\0');
  for (const auto& p : meta.parts()) {
    if (wanted && !wanted(p.offset(), p.size())) continue;
    if (auto st = read_part(p, buf, fn); !st) return st;
  }
  return {};
}

status checkpoint_store::read_planned(const pb::checkpoint_meta& meta, const load_plan& plan,
                                      const std::function<status(uint64_t, const char*, size_t)>& fn) {
  std::string buf(static_cast<size_t>(std::min<uint64_t>(chunk_bytes, std::max<uint64_t>(1, meta.state_bytes()))), '\0');
  for (const auto& r : plan.reads) {
    if (r.part < 0 || r.part >= meta.parts_size())
      return make_error("the load plan names part " + std::to_string(r.part) + " of a manifest of " + std::to_string(meta.parts_size()));
    auto st = read_part(meta.parts(r.part), buf, [&](uint64_t at, const char* data, size_t n) -> status {
      const uint64_t end = at + n;
      for (const auto& [a, b] : r.keep) {
        const uint64_t lo = std::max(a, at), hi = std::min(b, end);
        if (lo < hi)
          if (auto kept = fn(lo, data + (lo - at), static_cast<size_t>(hi - lo)); !kept) return kept;
      }
      return {};
    });
    if (!st) return st;
  }
  return {};
}

status checkpoint_store::read_part(const pb::checkpoint_part& p, std::string& buf, const std::function<status(uint64_t, const char*, size_t)>& fn) {
  hasher h;
  for (uint64_t at = 0; at < p.size();) {
    const uint64_t want = std::min<uint64_t>(buf.size(), p.size() - at);
    auto n = objects_->read(p.name(), at, buf.data(), want);
    if (!n) {
      auto size = objects_->size_of(p.name());
      return size && !size.value() ? corrupt(make_error("part '" + p.name() + "' is missing")) : n.err();
    }
    if (n.value() != want)
      return corrupt(
          make_error("part '" + p.name() + "' is truncated: " + std::to_string(at + n.value()) + " of " + std::to_string(p.size()) + " bytes"));
    h.update(buf.data(), want);
    if (auto st = fn(p.offset() + at, buf.data(), want); !st) return st;
    at += want;
  }
  if (h.digest() != p.xxh3()) return corrupt(make_error("checksum mismatch in part '" + p.name() + "'"));
  return {};
}

result<std::optional<pb::checkpoint_meta>> checkpoint_store::newest_valid(
    const std::function<void(const std::string&, const std::string&)>& on_skip, bool checksums, const std::set<int64_t>& excluded) {
  auto all = objects_->list();
  if (!all) return all.err();
  std::vector<std::pair<int64_t, std::string>> manifests;
  for (const auto& o : *all)
    if (auto step = manifest_step(o.name); step && !excluded.count(*step)) manifests.emplace_back(*step, o.name);
  std::sort(manifests.rbegin(), manifests.rend());
  // Checkpoints of the old single-file format are said, not silently passed
  // over (a run would otherwise start again from step 0 unannounced).
  if (on_skip)
    for (const auto& o : *all)
      if (o.name.rfind("ckpt-", 0) == 0 && o.name.size() > 4 && o.name.compare(o.name.size() - 4, 4, ".dtc") == 0)
        on_skip(location() + "/" + o.name, "a checkpoint of the old single-file format (before format 2), which this dtactor does not read");
  for (const auto& [step, name] : manifests) {
    auto meta = read_manifest(name);
    status st = meta ? verify(meta.value(), checksums) : status(meta.err());
    if (st) return std::optional<pb::checkpoint_meta>(std::move(meta.value()));
    if (on_skip) on_skip(location() + "/" + name, st.message());
  }
  return std::optional<pb::checkpoint_meta>();
}

result<committed_checkpoint> checkpoint_store::commit(pb::checkpoint_meta meta) {
  auto refuse = [](const std::string& why) { return make_error("checkpoint not saved: " + why); };
  meta.set_format_version(checkpoint_format_version);
  if (auto st = check_manifest(meta); !st) return refuse(st.message());
  const uint64_t newest = newest_generation();
  if (meta.generation() < newest)
    return make_error("refusing checkpoint from generation " + std::to_string(meta.generation()) + ": generation " +
                      std::to_string(newest) + " already committed here");
  if (auto st = verify(meta, false); !st)
    return refuse(st.message() + " in " + location() +
                  " (every node and the coordinator must reach the same checkpoint store: a shared directory or s3://)");
  const std::string name = manifest_name(meta.step());
  if (auto st = objects_->put(name, encode_manifest(meta)); !st) return refuse(st.message());
  auto kept = rotate(name);
  sweep_orphans(meta.step(), meta.generation());
  return committed_checkpoint{name, location() + "/" + name, meta.state_bytes(), std::move(kept)};
}

std::vector<int64_t> checkpoint_store::rotate(const std::string& just_written) {
  std::vector<scanned> valid;
  for (auto& s : scan())
    if (s.meta) valid.push_back(std::move(s));
  std::set<std::string> keep{just_written};
  for (size_t i = 0; i < valid.size() && i < static_cast<size_t>(policy_.keep_last); ++i) keep.insert(valid[valid.size() - 1 - i].name);
  if (policy_.keep_best && !policy_.best_metric.empty()) {
    const scanned* best = nullptr;
    double best_value = 0;
    for (const auto& s : valid) {  // ascending: on a tie the newer wins
      auto it = s.meta->metrics().find(policy_.best_metric);
      if (it == s.meta->metrics().end() || std::isnan(it->second)) continue;
      if (!best || (policy_.higher_is_better ? it->second >= best_value : it->second <= best_value)) {
        best = &s;
        best_value = it->second;
      }
    }
    if (best) keep.insert(best->name);
  }
  // The manifest goes first: a checkpoint half removed is no checkpoint,
  // and its parts are orphans the next sweep takes.
  std::vector<int64_t> kept;
  for (const auto& s : valid) {
    if (keep.count(s.name) || !objects_->remove(s.name)) {
      kept.push_back(s.step);
      continue;
    }
    for (const auto& p : s.meta->parts()) (void)objects_->remove(p.name());
  }
  return kept;
}

void checkpoint_store::sweep_orphans(int64_t up_to_step, uint64_t older_than_generation) {
  auto orphan = [&](const std::string& name) {
    auto id = parse_part_name(name);
    return id && (id->step <= up_to_step || id->generation < older_than_generation);
  };
  // Writes of such parts still in flight are from ranks that died mid-write
  // (or zombies of a fenced generation): a long-running coordinator sweeps
  // them here, not only at its next start.
  objects_->sweep_stale_writes(orphan);
  auto all = objects_->list();
  if (!all) return;
  std::set<std::string> referenced;
  for (const auto& s : scan()) {
    if (s.meta)
      for (const auto& p : s.meta->parts()) referenced.insert(p.name());
    referenced.insert(s.foreign_parts.begin(), s.foreign_parts.end());
  }
  for (const auto& o : *all) {
    if (!referenced.count(o.name) && orphan(o.name)) (void)objects_->remove(o.name);
  }
}

status checkpoint_store::check_no_foreign_manifests() {
  std::vector<std::string> foreign;
  for (const auto& s : scan())
    if (s.key_refused) foreign.push_back(s.name);
  if (foreign.empty()) return {};
  return make_error("checkpoint store " + location() + " holds checkpoints not signed with this job's key (" + foreign.back() +
                    (foreign.size() > 1 ? " and " + std::to_string(foreign.size() - 1) + " more" : "") +
                    "): start with the key they were written with (--key or DTACTOR_KEY_FILE; `dtactor local` keeps its own in RUN_DIR/job.key; "
                    "no key for unsigned ones), or set another checkpoint.dir; nothing there was changed");
}

std::vector<checkpoint_entry> checkpoint_store::list() {
  std::vector<checkpoint_entry> out;
  for (auto& s : scan()) {
    checkpoint_entry e{s.name, s.step, {}};
    if (s.meta) e.metrics.insert(s.meta->metrics().begin(), s.meta->metrics().end());
    out.push_back(std::move(e));
  }
  return out;
}

uint64_t checkpoint_store::newest_generation() {
  uint64_t newest = 0;
  for (const auto& s : scan())
    if (s.meta) newest = std::max<uint64_t>(newest, s.meta->generation());
  return newest;
}

result<checkpoint_target> open_checkpoint_target(const std::string& target,
                                                 const std::function<void(const std::string&, const std::string&)>& on_skip,
                                                 const std::string& s3_endpoint) {
  std::string location = target, manifest;
  const bool s3 = target.rfind("s3://", 0) == 0;
  if (s3 && target.size() > 9 && target.compare(target.size() - 9, 9, ".manifest") == 0) {
    const auto slash = target.rfind('/');
    location = target.substr(0, slash);
    manifest = target.substr(slash + 1);
  }
  std::error_code ec;
  if (!s3) {
    const std::filesystem::path p(target);
    if (std::filesystem::is_regular_file(p, ec)) {
      location = p.parent_path().empty() ? "." : p.parent_path().string();
      manifest = p.filename().string();
    } else if (std::filesystem::is_directory(p / "checkpoints", ec)) {
      location = (p / "checkpoints").string();
    } else if (!std::filesystem::is_directory(p, ec)) {
      return make_error("'" + target + "': no such checkpoint, checkpoint directory or run directory");
    }
  }
  auto store = checkpoint_store::open_readonly(location, s3_endpoint);
  if (!store) return store.err();
  checkpoint_target out;
  out.store = std::make_shared<checkpoint_store>(std::move(store.value()));
  if (!manifest.empty()) {
    auto meta = out.store->read_manifest(manifest);
    if (!meta) return make_error("'" + target + "': " + meta.message());
    if (auto st = out.store->verify(meta.value(), true); !st) return make_error("'" + target + "': " + st.message());
    out.meta = std::move(meta.value());
    out.name = target;
    return out;
  }
  // Skipped manifests are reported (on_skip) only when an older valid one is
  // used; when none is valid, the error names the newest one skipped and why
  // (one line for the user).
  std::vector<std::pair<std::string, std::string>> skipped;
  auto newest = out.store->newest_valid([&](const std::string& path, const std::string& why) { skipped.emplace_back(path, why); }, true);
  if (!newest) return newest.err();
  if (!newest.value()) {
    if (skipped.empty()) return make_error("no valid checkpoint in '" + out.store->location() + "'");
    return make_error("no valid checkpoint in '" + out.store->location() + "': " + skipped.front().first + ": " + skipped.front().second +
                      (skipped.size() > 1 ? " (and " + std::to_string(skipped.size() - 1) + " older ones skipped)" : ""));
  }
  if (on_skip)
    for (const auto& [path, why] : skipped) on_skip(path, why);
  out.meta = std::move(*newest.value());
  out.name = out.store->location() + "/" + manifest_name(out.meta.step());
  return out;
}

}  // namespace dtactor
