// The public shard reader (include/dtactor/shards.hpp) over the data room's
// (data/data_shards.hpp): what a task of one's own sees of a sharded
// data key. Torch-free, as the reader.
#include "dtactor/shards.hpp"

#include <filesystem>
#include <variant>

#include "data/data_shards.hpp"
#include "job/job_config.hpp"
#include "data/webdataset.hpp"

namespace dtactor {

struct shard_set::impl {
  std::string key, spec;
  bool sharded = false;
  std::vector<shard_entry> entries;
  std::unique_ptr<shard_reader> reader;
};

namespace {
bool is_remote(const std::string& url) { return url.rfind("s3://", 0) == 0; }
}  // namespace

result<std::unique_ptr<shard_set>> shard_set::open(const config& cfg, const std::string& key, shard_use use) {
  const auto it = cfg.values().find(key);
  if (it == cfg.values().end()) return make_error("shards: '" + key + "' is not a config key (declare it in the task's registration)");
  if (!std::holds_alternative<std::string>(it->second)) return make_error("shards: '" + key + "' is not a string key: it cannot name shards");
  const std::string& spec = std::get<std::string>(it->second);
  if (spec.empty())
    return make_error(key +
                      " is empty: name a file, or shards (a glob such as data/train-*.csv, a {000..127} range, a comma-separated list, s3://...)");
  const shard_read_settings reads = shard_read_settings_of(cfg);
  result<std::vector<shard_info>> shards = std::vector<shard_info>{};
  if (names_shards(spec)) {
    shards = resolve_shards(spec, reads.cache.s3_endpoint);
    if (!shards) return make_error(key + ": " + shards.message());
  } else {
    // One local file: a set of one, whatever shard index its directory
    // holds (an index covers the shards of a spec, e.g. train-*.csv beside
    // eval.csv; the file itself is checked across nodes by its digest).
    std::error_code ec;
    const std::string path = std::filesystem::absolute(spec, ec).lexically_normal().string();
    const auto size = std::filesystem::file_size(path, ec);
    if (ec) return make_error(key + ": cannot read '" + path + "': " + ec.message());
    shards->push_back({path, static_cast<uint64_t>(size), "", -1});
  }
  if (use == shard_use::train) {
    std::vector<uint64_t> remote;
    for (const auto& s : shards.value()) remote.push_back(is_remote(s.url) ? s.bytes : 0);
    if (auto st = check_training_cache(reads, std::move(remote)); !st) return make_error(key + ": " + st.message());
  }
  auto d = std::make_unique<impl>();
  d->key = key;
  d->spec = spec;
  d->sharded = names_shards(spec);
  for (const auto& s : shards.value()) d->entries.push_back({s.url, s.bytes, s.records});
  auto reader = shard_reader::open(std::move(shards.value()), reads.cache);
  if (!reader) return make_error(key + ": " + reader.message());
  d->reader = std::move(reader.value());
  std::unique_ptr<shard_set> out(new shard_set);
  out->impl_ = std::move(d);
  return out;
}

shard_set::~shard_set() = default;

const std::string& shard_set::key() const { return impl_->key; }
const std::string& shard_set::spec() const { return impl_->spec; }
bool shard_set::sharded() const { return impl_->sharded; }
size_t shard_set::size() const { return impl_->entries.size(); }
const std::vector<shard_entry>& shard_set::shards() const { return impl_->entries; }

result<shard_data> shard_set::get(size_t i) {
  if (i >= size())
    return make_error(impl_->key + ": shard " + std::to_string(i) + " asked for, the set has " + std::to_string(size()) + " (0 to " +
                      std::to_string(size()) + " - 1)");
  auto b = impl_->reader->get(i);
  if (!b) return make_error(impl_->key + ": " + b.message());
  shard_data out;
  out.data_ = b.value()->data();
  out.size_ = b.value()->size();
  out.keep_ = std::move(b.value());
  return out;
}

void shard_set::read_ahead(const std::vector<int64_t>& next) {
  std::vector<size_t> ids;
  for (int64_t k : next)
    if (k >= 0 && static_cast<size_t>(k) < size()) ids.push_back(static_cast<size_t>(k));
  impl_->reader->read_ahead(std::move(ids));
}

result<int64_t> shard_set::records(size_t i) {
  if (i >= size())
    return make_error(impl_->key + ": shard " + std::to_string(i) + " asked for, the set has " + std::to_string(size()) + " (0 to " +
                      std::to_string(size()) + " - 1)");
  shard_entry& e = impl_->entries[i];
  if (e.records >= 0) return e.records;
  if (is_remote(e.url))
    return make_error(impl_->key + ": shard " + e.url + " has no record count: run `dtactor data index '" + impl_->spec +
                      "'` once, so that nodes know every shard's records without fetching it");
  auto b = get(i);
  if (!b) return b.err();
  auto n = count_records(e.url, b->data(), b->size(), "shard " + e.url);
  if (!n) return make_error(impl_->key + ": " + n.message());
  if (n.value() < 0)
    return make_error(impl_->key + ": shard " + e.url +
                      " is of a kind without a record count (dtactor counts the samples of .tar, the rows of .npy and the lines of .csv, .tsv, "
                      ".jsonl and .txt shards)");
  e.records = n.value();
  return e.records;
}

result<std::vector<int64_t>> shard_set::all_records() {
  std::vector<int64_t> out;
  for (size_t i = 0; i < size(); ++i) {
    auto n = records(i);
    if (!n) return n.err();
    out.push_back(n.value());
  }
  return out;
}

}  // namespace dtactor
