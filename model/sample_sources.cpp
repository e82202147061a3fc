#include "model/sample_sources.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <string_view>
#include <condition_variable>
#include <thread>

#include "data/image_decode.hpp"
#include "job/job_config.hpp"
#include "data/webdataset.hpp"

namespace dtactor {

namespace {

// What a sample of this dtype becomes: floats as float32, integers as int64.
c10::ScalarType batch_type_of(npy_dtype d) {
  const bool floating = d == npy_dtype::f2 || d == npy_dtype::f4 || d == npy_dtype::f8;
  return d == npy_dtype::b1 ? torch::kBool : floating ? torch::kFloat : torch::kLong;
}

template <class From, class To>
void convert(const uint8_t* p, int64_t count, To* out) {
  for (int64_t k = 0; k < count; ++k) {
    From v;
    std::memcpy(&v, p + static_cast<size_t>(k) * sizeof(From), sizeof(From));  // little-endian, maybe unaligned
    out[k] = static_cast<To>(v);
  }
}

// `count` elements of dtype `d` at `p` into `dst`, of batch_type_of(d):
// plain loops, no tensor operation per sample.
void write_elements(const uint8_t* p, npy_dtype d, int64_t count, void* dst) {
  auto* f = static_cast<float*>(dst);
  auto* l = static_cast<int64_t*>(dst);
  switch (d) {
    case npy_dtype::b1: std::memcpy(dst, p, static_cast<size_t>(count)); return;
    case npy_dtype::f2: convert<c10::Half>(p, count, f); return;
    case npy_dtype::f4: std::memcpy(dst, p, static_cast<size_t>(count) * 4); return;
    case npy_dtype::f8: convert<double>(p, count, f); return;
    case npy_dtype::u1: convert<uint8_t>(p, count, l); return;
    case npy_dtype::i1: convert<int8_t>(p, count, l); return;
    case npy_dtype::u2: convert<uint16_t>(p, count, l); return;
    case npy_dtype::i2: convert<int16_t>(p, count, l); return;
    case npy_dtype::u4: convert<uint32_t>(p, count, l); return;
    case npy_dtype::i4: convert<int32_t>(p, count, l); return;
    case npy_dtype::u8: convert<uint64_t>(p, count, l); return;
    case npy_dtype::i8: std::memcpy(dst, p, static_cast<size_t>(count) * 8); return;
  }
}

}  // namespace

torch::Tensor rows_of(const npy_array& a, const std::vector<int64_t>& idx) {
  std::vector<int64_t> shape = a.shape();
  shape[0] = static_cast<int64_t>(idx.size());
  int64_t per_row = 1;
  for (size_t i = 1; i < a.shape().size(); ++i) per_row *= a.shape()[i];
  auto out = torch::empty(shape, batch_type_of(a.dtype()));
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  const size_t row_out = static_cast<size_t>(per_row) * out.element_size();
  for (size_t r = 0; r < idx.size(); ++r) write_elements(a.row(idx[r]), a.dtype(), per_row, dst + r * row_out);
  return out;
}

std::pair<torch::Tensor, torch::Tensor> token_source::batch(const std::vector<int64_t>& rows) const {
  const int64_t n = static_cast<int64_t>(rows.size());
  auto x = torch::empty({n, context_}, torch::kLong), y = torch::empty({n, context_}, torch::kLong);
  std::vector<int64_t> w;
  for (int64_t r = 0; r < n; ++r) {
    f_->window(static_cast<uint64_t>(first_ + rows[static_cast<size_t>(r)] * stride_), static_cast<uint64_t>(context_ + 1), w);
    std::memcpy(x[r].data_ptr<int64_t>(), w.data(), static_cast<size_t>(context_) * sizeof(int64_t));
    std::memcpy(y[r].data_ptr<int64_t>(), w.data() + 1, static_cast<size_t>(context_) * sizeof(int64_t));
  }
  return {x, y};
}

std::pair<torch::Tensor, torch::Tensor> subset_source::batch(const std::vector<int64_t>& rows) const {
  std::vector<int64_t> r(rows);
  for (auto& v : r) v += from_;
  return s_->batch(r);
}

// ---------------------------------------------------------------------------
// Sharded sources.

sharded_source::sharded_source(std::shared_ptr<shard_reader> reader, std::vector<std::vector<size_t>> ids, std::vector<int64_t> per_shard)
    : reader_(std::move(reader)), ids_(std::move(ids)), per_shard_(std::move(per_shard)) {
  first_.push_back(0);
  for (int64_t n : per_shard_) first_.push_back(first_.back() + n);
}

std::vector<size_t> sharded_source::reader_ids(const std::vector<int64_t>& ks) const {
  std::vector<size_t> out;
  for (int64_t k : ks)
    for (size_t id : ids_[static_cast<size_t>(k)]) out.push_back(id);
  return out;
}

void sharded_source::upcoming(const std::vector<int64_t>& ks) {
  reader_->read_ahead(reader_ids(ks));
  hold_only(ks);
}

void sharded_source::read_ahead_from(int64_t row, int64_t count) {
  if (row >= size()) return;
  std::vector<int64_t> ks;
  for (int64_t k = locate(row).first; k < static_cast<int64_t>(ids_.size()) && static_cast<int64_t>(ks.size()) < count; ++k) ks.push_back(k);
  reader_->read_ahead(reader_ids(ks));
}

void sharded_source::hold_only(const std::vector<int64_t>& ks) {
  const std::set<int64_t> keep(ks.begin(), ks.end());
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = held_.begin(); it != held_.end();) {
    if (keep.count(it->first.first)) {
      ++it;
      continue;
    }
    if (it->first.second == 0) released(it->first.first);
    it = held_.erase(it);
  }
}

status sharded_source::open_shard(int64_t k) {
  try {
    for (size_t part = 0; part < ids_[static_cast<size_t>(k)].size(); ++part) (void)bytes(k, part);
    return {};
  } catch (const std::exception& e) {
    return make_error(e.what());
  }
}

std::pair<int64_t, int64_t> sharded_source::locate(int64_t i) const {
  const int64_t k = std::upper_bound(first_.begin(), first_.end(), i) - first_.begin() - 1;
  return {k, i - first_[static_cast<size_t>(k)]};
}

const std::string& sharded_source::url(int64_t k, size_t part) const { return reader_->shards()[ids_[static_cast<size_t>(k)][part]].url; }

std::shared_ptr<const shard_bytes> sharded_source::bytes_ptr(int64_t k, size_t part) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = held_.find({k, part}); it != held_.end()) return it->second;
  }
  const size_t id = ids_[static_cast<size_t>(k)][part];
  auto b = reader_->get(id);  // thread-safe; may wait for a fetch
  if (!b) throw data_error(b.message());
  std::lock_guard<std::mutex> lock(mu_);
  if (!checked_.count(id)) {
    check_shard(k, part, *b.value());
    checked_.insert(id);
  }
  return held_[{k, part}] = b.value();
}

namespace {

// Windows of token shards: sample i is the window at (i - first sample of
// its shard) * stride in its shard; windows never cross a shard's end. Each
// shard's ids are checked against the vocabulary the first time this
// process reads it.
class token_shard_source final : public sharded_source {
 public:
  token_shard_source(std::shared_ptr<shard_reader> reader, std::vector<std::vector<size_t>> ids, int64_t context, int64_t stride, uint32_t vocab)
      : sharded_source(reader, ids, counts(*reader, ids, context, stride)), context_(context), stride_(stride), vocab_(vocab) {}

  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& rows) const override {
    const int64_t n = static_cast<int64_t>(rows.size());
    auto x = torch::empty({n, context_}, torch::kLong), y = torch::empty({n, context_}, torch::kLong);
    for (int64_t r = 0; r < n; ++r) {
      const auto [k, j] = locate(rows[static_cast<size_t>(r)]);
      const uint8_t* p = bytes(k).data() + 2 * j * stride_;
      auto* xp = x[r].data_ptr<int64_t>();
      auto* yp = y[r].data_ptr<int64_t>();
      for (int64_t t = 0; t <= context_; ++t) {
        const int64_t id = p[2 * t] | (p[2 * t + 1] << 8);
        if (t < context_) xp[t] = id;
        if (t > 0) yp[t - 1] = id;
      }
    }
    return {x, y};
  }

 private:
  static std::vector<int64_t> counts(const shard_reader& r, const std::vector<std::vector<size_t>>& ids, int64_t context, int64_t stride) {
    std::vector<int64_t> out;
    for (const auto& k : ids) {
      const int64_t tokens = static_cast<int64_t>(r.shards()[k[0]].bytes / 2);
      out.push_back(stride == 1 ? tokens - context : (tokens - 1) / context);
    }
    return out;
  }
  void check_shard(int64_t k, size_t, const shard_bytes& b) const override {
    if (b.size() % 2 != 0)
      throw data_error("shard " + url(k) + " holds " + std::to_string(b.size()) + " bytes, an odd number: not a stream of uint16 token ids");
    for (size_t t = 0; t < b.size() / 2; ++t) {
      const uint32_t v = b.data()[2 * t] | (b.data()[2 * t + 1] << 8);
      if (v >= vocab_)
        throw data_error("shard " + url(k) + ": token id " + std::to_string(v) + " at position " + std::to_string(t) +
                         " is outside the model's vocabulary of " + std::to_string(vocab_));
    }
  }

  int64_t context_, stride_;
  uint32_t vocab_;
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t from = 0;
  for (;;) {
    const size_t semi = s.find_first_of(";,", from);
    std::string item = s.substr(from, semi == std::string::npos ? std::string::npos : semi - from);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    while (!item.empty() && item.front() == '.') item.erase(0, 1);
    for (auto& c : item) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (!item.empty()) out.push_back(item);
    if (semi == std::string::npos) return out;
    from = semi + 1;
  }
}

// The kind of a member by its extension's last part.
std::string kind_of(const std::string& ext) {
  const auto dot = ext.rfind('.');
  return dot == std::string::npos ? ext : ext.substr(dot + 1);
}

bool readable_kind(const std::string& ext) {
  const std::string k = kind_of(ext);
  return k == "png" || k == "jpg" || k == "jpeg" || k == "npy" || k == "cls";
}

// WebDataset-style tar shards: sample j of a shard is its j-th key.
class tar_shard_source final : public sharded_source {
 public:
  tar_shard_source(std::shared_ptr<shard_reader> reader, std::vector<std::vector<size_t>> ids, std::vector<int64_t> per_shard,
                   std::vector<std::string> inputs, std::vector<std::string> targets)
      : sharded_source(std::move(reader), std::move(ids), std::move(per_shard)), inputs_(std::move(inputs)), targets_(std::move(targets)) {}
  ~tar_shard_source() override {
    {
      std::lock_guard<std::mutex> lock(ahead_mu_);
      stop_ = true;
    }
    ahead_cv_.notify_all();
    if (ahead_.joinable()) ahead_.join();
  }

  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& rows) const override {
    std::vector<value> xs, ys;
    std::vector<std::pair<int64_t, std::string>> where;
    std::vector<std::shared_ptr<const shard_bytes>> keep;
    for (int64_t i : rows) {
      std::optional<decoded_sample> got;
      {
        std::lock_guard<std::mutex> lock(ahead_mu_);
        if (auto it = ready_.find(i); it != ready_.end()) {
          got = std::move(it->second);
          ready_.erase(it);
        }
      }
      if (!got) got = decode(i);  // not decoded ahead (or it failed there): here, where an error is thrown
      xs.push_back(std::move(got->x));
      ys.push_back(std::move(got->y));
      where.emplace_back(got->shard, std::move(got->key));
      keep.push_back(std::move(got->keep));
    }
    return {stack(xs, where, "input"), stack(ys, where, "target")};
  }

  // Decodes these samples on a thread of this source while the step runs
  // (the engine names the next step's samples): PNG and JPEG decoding stays
  // out of the step, as a DataLoader's workers keep it out of PyTorch's.
  void upcoming_samples(const std::vector<int64_t>& indices) override {
    {
      std::lock_guard<std::mutex> lock(ahead_mu_);
      // Kept: what was decoded for the step about to run (named by the
      // previous call) and for the one named now; older samples go.
      std::set<int64_t> keep(indices.begin(), indices.end());
      keep.insert(want_.begin(), want_.end());
      for (auto it = ready_.begin(); it != ready_.end();) it = keep.count(it->first) ? std::next(it) : ready_.erase(it);
      want_ = indices;
      ++want_generation_;
      if (!ahead_.joinable()) ahead_ = std::thread([this] { decode_ahead(); });
    }
    ahead_cv_.notify_all();
  }

 private:
  struct value;
  struct decoded_sample;

  void decode_ahead() {
    std::unique_lock<std::mutex> lock(ahead_mu_);
    uint64_t seen = 0;
    for (;;) {
      ahead_cv_.wait(lock, [&] { return stop_ || want_generation_ != seen; });
      if (stop_) return;
      seen = want_generation_;
      const std::vector<int64_t> want = want_;
      for (int64_t i : want) {
        if (stop_ || want_generation_ != seen) break;
        if (ready_.count(i)) continue;
        lock.unlock();
        std::optional<decoded_sample> d;
        try {
          d = decode(i);
        } catch (const std::exception&) {
          // Left to the training thread, which decodes it again and says why.
        }
        lock.lock();
        if (d) ready_.emplace(i, std::move(*d));  // a newer call drops it if no step wants it
      }
    }
  }


  // A member read: an image (float [C, H, W] in [0, 1]), an .npy array (as
  // it is), or a class id; written straight into the batch tensor.
  struct value {
    std::vector<int64_t> shape;
    c10::ScalarType type = torch::kFloat;
    decoded_image image;
    const uint8_t* array = nullptr;
    npy_dtype dtype = npy_dtype::f4;
    int64_t cls = 0;
    enum { image_kind, array_kind, cls_kind } kind = cls_kind;
    int64_t count() const { return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>()); }
    void write(void* dst) const {
      if (kind == cls_kind) {
        *static_cast<int64_t*>(dst) = cls;
      } else if (kind == array_kind) {
        write_elements(array, dtype, count(), dst);
      } else {
        auto* out = static_cast<float*>(dst);
        const int64_t c = image.channels, hw = image.height * image.width;
        for (int64_t ch = 0; ch < c; ++ch)
          for (int64_t i = 0; i < hw; ++i) out[ch * hw + i] = static_cast<float>(image.pixels[static_cast<size_t>(i * c + ch)]) / 255.0f;
      }
    }
  };

  struct decoded_sample {
    value x, y;
    int64_t shard = 0;
    std::string key;
    std::shared_ptr<const shard_bytes> keep;  // an .npy member is read in place when the batch is stacked
  };

  // Sample i's input and target. Thread-safe: the shard's bytes and sample
  // table are held by pointer while they are read.
  decoded_sample decode(int64_t i) const {
    const auto [k, j] = locate(i);
    auto b = bytes_ptr(k);
    auto t = table(k, *b);
    const tar_sample& s = (*t)[static_cast<size_t>(j)];
    return decoded_sample{member(k, *b, s, inputs_, "data.shard_inputs"), member(k, *b, s, targets_, "data.shard_targets"), k, s.key, b};
  }

  torch::Tensor stack(const std::vector<value>& vs, const std::vector<std::pair<int64_t, std::string>>& where, const char* what) const {
    std::vector<int64_t> shape = {static_cast<int64_t>(vs.size())};
    shape.insert(shape.end(), vs.front().shape.begin(), vs.front().shape.end());
    auto out = torch::empty(shape, vs.front().type);
    auto* dst = static_cast<uint8_t*>(out.data_ptr());
    const size_t per = static_cast<size_t>(vs.front().count()) * out.element_size();
    for (size_t r = 0; r < vs.size(); ++r) {
      if (vs[r].shape != vs.front().shape || vs[r].type != vs.front().type) {
        std::ostringstream o;
        o << "shard " << url(where[r].first) << ": sample '" << where[r].second << "' has a " << what << " of shape "
          << c10::IntArrayRef(vs[r].shape) << " (" << vs[r].type << "), the batch's first " << c10::IntArrayRef(vs.front().shape) << " ("
          << vs.front().type << "): every sample must have the same shapes";
        throw data_error(o.str());
      }
      vs[r].write(dst + r * per);
    }
    return out;
  }

  // Shard k's samples (its headers walked once while it is held).
  std::shared_ptr<const std::vector<tar_sample>> table(int64_t k, const shard_bytes& b) const {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = tables_.find(k); it != tables_.end()) return it->second;
    }
    auto t = read_tar_samples(b.data(), b.size(), "shard " + url(k));
    if (!t) throw data_error(t.message());
    if (static_cast<int64_t>(t->size()) != per_shard_[static_cast<size_t>(k)])
      throw data_error("shard " + url(k) + " holds " + std::to_string(t->size()) + " samples, the shard index says " +
                       std::to_string(per_shard_[static_cast<size_t>(k)]) + " (changed since `dtactor data index`: index it again)");
    auto made = std::make_shared<const std::vector<tar_sample>>(std::move(t.value()));
    std::lock_guard<std::mutex> lock(mu_);
    return tables_.emplace(k, std::move(made)).first->second;
  }
  void released(int64_t k) const override { tables_.erase(k); }  // under mu_

  value member(int64_t k, const shard_bytes& b, const tar_sample& s, const std::vector<std::string>& exts, const char* key) const {
    for (const std::string& ext : exts) {
      const tar_entry* e = s.member(ext);
      if (!e) continue;
      auto where = [&] { return "shard " + url(k) + ": '" + e->name + "'"; };
      const uint8_t* p = b.data() + e->offset;
      const std::string kind = kind_of(ext);
      value v;
      if (kind == "png" || kind == "jpg" || kind == "jpeg") {
        auto img = decode_image(p, e->size, kind, where());
        if (!img) throw data_error(img.message());
        v.kind = value::image_kind;
        v.image = std::move(img.value());
        v.shape = {v.image.channels, v.image.height, v.image.width};
        v.type = torch::kFloat;
        return v;
      }
      if (kind == "npy") {
        auto h = parse_npy_header(std::string_view(reinterpret_cast<const char*>(p), std::min<uint64_t>(e->size, 65536)), e->size);
        if (!h) throw data_error(where() + ": " + h.message());
        v.kind = value::array_kind;
        v.shape = h->shape;
        v.dtype = h->dtype;
        v.type = batch_type_of(h->dtype);
        v.array = p + h->data_offset;
        return v;
      }
      if (kind == "cls") {
        std::string_view text(reinterpret_cast<const char*>(p), e->size);
        while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
        while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
        auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v.cls);
        if (ec != std::errc() || end != text.data() + text.size() || text.empty()) throw data_error(where() + ": not a class id (a decimal integer)");
        v.kind = value::cls_kind;
        v.type = torch::kLong;
        return v;
      }
    }
    std::string wanted;
    for (const auto& e : exts) wanted += (wanted.empty() ? "." : ", .") + e;
    throw data_error("shard " + url(k) + ": sample '" + s.key + "' has no member of " + key + " (" + wanted + ")");
  }

  std::vector<std::string> inputs_, targets_;
  mutable std::map<int64_t, std::shared_ptr<const std::vector<tar_sample>>> tables_;  // under mu_
  // Decoding ahead.
  mutable std::mutex ahead_mu_;
  std::condition_variable ahead_cv_;
  std::vector<int64_t> want_;
  uint64_t want_generation_ = 0;
  bool stop_ = false;
  mutable std::map<int64_t, decoded_sample> ready_;
  std::thread ahead_;
};

// .npy shard pairs: row j of logical shard k is row j of input shard k and
// of target shard k.
class npy_shard_source final : public sharded_source {
 public:
  using sharded_source::sharded_source;

  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& rows) const override {
    std::vector<torch::Tensor> xs, ys;
    for (int64_t i : rows) {
      const auto [k, j] = locate(i);
      xs.push_back(row(k, 0, j));
      ys.push_back(row(k, 1, j));
      if (xs.size() > 1) same_shape(k, xs.front(), xs.back()), same_shape(k, ys.front(), ys.back());
    }
    return {torch::stack(xs), torch::stack(ys)};
  }

 private:
  torch::Tensor row(int64_t k, size_t part, int64_t j) const {
    const shard_bytes& b = bytes(k, part);
    auto h = parse_npy_header(std::string_view(reinterpret_cast<const char*>(b.data()), std::min<size_t>(b.size(), 65536)), b.size());
    if (!h) throw data_error("shard " + url(k, part) + ": " + h.message());
    if (h->shape[0] != per_shard_[static_cast<size_t>(k)])
      throw data_error("shard " + url(k, part) + " holds " + std::to_string(h->shape[0]) + " rows, the shard index says " +
                       std::to_string(per_shard_[static_cast<size_t>(k)]) + " (changed since `dtactor data index`: index it again)");
    std::vector<int64_t> shape(h->shape.begin() + 1, h->shape.end());
    const int64_t per_row = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
    auto t = torch::empty(shape, batch_type_of(h->dtype));
    write_elements(b.data() + h->data_offset + static_cast<size_t>(j * per_row) * item_bytes(h->dtype), h->dtype, per_row, t.data_ptr());
    return t;
  }
  void same_shape(int64_t k, const torch::Tensor& first, const torch::Tensor& t) const {
    if (first.sizes() == t.sizes() && first.scalar_type() == t.scalar_type()) return;
    std::ostringstream o;
    o << "shard " << url(k) << ": rows of shape " << t.sizes() << " (" << t.scalar_type() << ") in a batch whose first row is " << first.sizes()
      << " (" << first.scalar_type() << "): every shard of a key must have the same row shape and dtype";
    throw data_error(o.str());
  }
};

// The shards of the train and eval splits before a reader is opened:
// each logical shard is one or more of `all`.
struct split_plan {
  std::vector<shard_info> all;
  std::vector<std::vector<size_t>> train, eval;
};

// A data key and its value, a shard spec (the key names it in errors).
struct keyed_spec {
  std::string key;
  std::string spec;
};

result<std::vector<shard_info>> resolve_key(const shard_read_settings& reads, const keyed_spec& k) {
  const std::string& key = k.key;
  auto r = resolve_shards(k.spec, reads.cache.s3_endpoint);
  if (!r) return make_error(key + ": " + r.message());
  return r;
}

// Adds shards as logical shards of one part each (or pairs them when
// `second` is given: inputs and targets, in order).
result<std::vector<std::vector<size_t>>> add_logical(split_plan& p, const std::string& key, std::vector<shard_info> first,
                                                     const std::string& second_key = "", std::vector<shard_info> second = {}) {
  if (!second_key.empty() && first.size() != second.size())
    return make_error(key + " names " + std::to_string(first.size()) + " shard(s), " + second_key + " " + std::to_string(second.size()) +
                      ": they pair in order, so they must name as many");
  std::vector<std::vector<size_t>> out;
  for (size_t i = 0; i < first.size(); ++i) {
    out.push_back({p.all.size()});
    p.all.push_back(std::move(first[i]));
    if (!second_key.empty()) {
      out.back().push_back(p.all.size());
      p.all.push_back(std::move(second[i]));
    }
  }
  return out;
}

// Without an eval key, the last data.val_fraction of the logical shards (at
// least one, whole shards) are held out, so no evaluation sample is ever
// trained on.
status hold_out(split_plan& p, double val_fraction, const std::string& key, const std::string& eval_key) {
  const size_t n = p.train.size();
  if (n < 2) return make_error(key + " names one shard: set " + eval_key + ", or give two or more shards (the last data.val_fraction of them are held out)");
  const size_t held = std::clamp<size_t>(static_cast<size_t>(std::llround(val_fraction * static_cast<double>(n))), 1, n - 1);
  p.eval.assign(p.train.end() - static_cast<std::ptrdiff_t>(held), p.train.end());
  p.train.resize(n - held);
  return {};
}

// The cache must hold what a step reads and what is fetched ahead of it.
result<std::shared_ptr<shard_reader>> open_reader(const shard_read_settings& reads, split_plan& p) {
  std::vector<uint64_t> remote;
  for (const auto& k : p.train) {
    uint64_t bytes = 0;
    for (size_t id : k)
      if (p.all[id].url.rfind("s3://", 0) == 0) bytes += p.all[id].bytes;
    remote.push_back(bytes);
  }
  if (auto st = check_training_cache(reads, std::move(remote)); !st) return st.err();
  auto r = shard_reader::open(std::move(p.all), reads.cache);
  if (!r) return r.err();
  return std::shared_ptr<shard_reader>(std::move(r.value()));
}

// Records (samples, rows) of each logical shard: from the shard index, or,
// for a local shard without one, counted from its bytes (mapped in place).
// A remote shard without an index count is refused: counting it would
// fetch the whole data set before training.
result<std::vector<int64_t>> records_of(shard_reader& reader, const std::vector<std::vector<size_t>>& ks, const std::string& key,
                                        const std::string& spec) {
  std::vector<int64_t> out;
  for (const auto& k : ks) {
    const shard_info& s = reader.shards()[k[0]];
    int64_t n = s.records;
    if (n < 0) {
      if (s.url.rfind("s3://", 0) == 0)
        return make_error(key + ": shard " + s.url + " has no sample count: run `dtactor data index '" + spec +
                          "'` once, so that nodes know every shard's samples without fetching it");
      auto b = reader.get(k[0]);
      if (!b) return make_error(key + ": " + b.message());
      auto c = count_records(s.url, b.value()->data(), b.value()->size(), "shard " + s.url);
      if (!c) return make_error(key + ": " + c.message());
      n = c.value();
    }
    if (n < 1) return make_error(key + ": shard " + s.url + " holds no samples");
    out.push_back(n);
  }
  return out;
}

}  // namespace

result<sharded_split> open_token_shards(const model_settings& m, const data_settings& d) {
  const int64_t context = m.context;
  const auto vocab = static_cast<uint32_t>(m.vocab_size);
  auto resolve = [&](const std::string& key, const std::string& spec) -> result<std::vector<shard_info>> {
    auto r = resolve_key(d.shards, {key, spec});
    if (!r) return r;
    for (const auto& sh : r.value()) {
      if (sh.bytes % 2 != 0)
        return make_error(key + ": shard " + sh.url + " holds " + std::to_string(sh.bytes) + " bytes, an odd number: not a stream of uint16 token ids");
      if (sh.bytes / 2 < static_cast<uint64_t>(context) + 2)
        return make_error(key + ": shard " + sh.url + " holds " + std::to_string(sh.bytes / 2) + " tokens; every shard needs at least " +
                          std::to_string(context + 2) + " (one window of model.context + 1, and one more)");
    }
    return r;
  };
  split_plan p;
  auto tr = resolve("data.train_tokens", d.train_tokens);
  if (!tr) return tr.err();
  p.train = add_logical(p, "data.train_tokens", std::move(tr.value())).value();
  if (!d.eval_tokens.empty()) {
    auto ev = resolve("data.eval_tokens", d.eval_tokens);
    if (!ev) return ev.err();
    p.eval = add_logical(p, "data.eval_tokens", std::move(ev.value())).value();
  } else if (auto st = hold_out(p, d.val_fraction, "data.train_tokens", "data.eval_tokens"); !st) {
    return st.err();
  }
  auto reader = open_reader(d.shards, p);
  if (!reader) return reader.err();
  sharded_split out;
  out.reader = reader.value();
  out.train = std::make_shared<token_shard_source>(out.reader, p.train, context, 1, vocab);
  out.eval = std::make_shared<token_shard_source>(out.reader, p.eval, context, context, vocab);
  if (auto st = out.train->open_shard(0); !st) return make_error("data.train_tokens: " + st.message());
  return out;
}

result<sharded_split> open_tar_shards(const data_settings& d) {
  const auto inputs = split_list(d.shard_inputs);
  const auto targets = split_list(d.shard_targets);
  if (inputs.empty()) return make_error("data.shard_inputs is empty: name the members that are a sample's input, e.g. \"jpg;png\"");
  if (targets.empty()) return make_error("data.shard_targets is empty: name the members that are a sample's target, e.g. \"cls\"");
  for (const auto* list : {&inputs, &targets})
    for (const std::string& e : *list)
      if (!readable_kind(e))
        return make_error(std::string(list == &inputs ? "data.shard_inputs" : "data.shard_targets") + ": '." + e +
                          "' members cannot be read: dtactor reads .png, .jpg and .jpeg (images), .npy (arrays) and .cls (class ids)");
  auto check = [](const std::string& key, const std::vector<shard_info>& shards) -> status {
    for (const auto& s : shards) {
      const auto dot = s.url.rfind('.');
      if (dot == std::string::npos || s.url.substr(dot) != ".tar")
        return make_error(key + ": shard " + s.url + " is not a .tar file (WebDataset-style tar shards; token streams go to data.train_tokens)");
    }
    return {};
  };
  split_plan p;
  const keyed_spec train_key{"data.train_shards", d.train_shards};
  const keyed_spec eval_key = d.eval_shards.empty() ? train_key : keyed_spec{"data.eval_shards", d.eval_shards};
  auto tr = resolve_key(d.shards, train_key);
  if (!tr) return tr.err();
  if (auto st = check("data.train_shards", tr.value()); !st) return st.err();
  p.train = add_logical(p, "data.train_shards", std::move(tr.value())).value();
  if (!d.eval_shards.empty()) {
    auto ev = resolve_key(d.shards, eval_key);
    if (!ev) return ev.err();
    if (auto st = check("data.eval_shards", ev.value()); !st) return st.err();
    p.eval = add_logical(p, "data.eval_shards", std::move(ev.value())).value();
  } else if (auto st = hold_out(p, d.val_fraction, "data.train_shards", "data.eval_shards"); !st) {
    return st.err();
  }
  auto reader = open_reader(d.shards, p);
  if (!reader) return reader.err();
  auto train_n = records_of(*reader.value(), p.train, train_key.key, train_key.spec);
  if (!train_n) return train_n.err();
  auto eval_n = records_of(*reader.value(), p.eval, eval_key.key, eval_key.spec);
  if (!eval_n) return eval_n.err();
  sharded_split out;
  out.reader = reader.value();
  out.train = std::make_shared<tar_shard_source>(out.reader, p.train, train_n.value(), inputs, targets);
  out.eval = std::make_shared<tar_shard_source>(out.reader, p.eval, eval_n.value(), inputs, targets);
  if (auto st = out.train->open_shard(0); !st) return make_error("data.train_shards: " + st.message());
  return out;
}

result<sharded_split> open_npy_shards(const data_settings& d) {
  const keyed_spec train_in{"data.train_inputs", d.train_inputs}, train_tg{"data.train_targets", d.train_targets};
  const keyed_spec eval_in{"data.eval_inputs", d.eval_inputs}, eval_tg{"data.eval_targets", d.eval_targets};
  auto pair = [&](const keyed_spec& in, const keyed_spec& tg) -> result<std::pair<std::vector<shard_info>, std::vector<shard_info>>> {
    auto a = resolve_key(d.shards, in);
    if (!a) return a.err();
    auto b = resolve_key(d.shards, tg);
    if (!b) return b.err();
    for (const auto* set : {&a.value(), &b.value()})
      for (const auto& s : *set)
        if (s.url.size() < 4 || s.url.substr(s.url.size() - 4) != ".npy")
          return make_error((set == &a.value() ? in.key : tg.key) + ": shard " + s.url + " is not a .npy file");
    return std::make_pair(std::move(a.value()), std::move(b.value()));
  };
  split_plan p;
  auto tr = pair(train_in, train_tg);
  if (!tr) return tr.err();
  auto train = add_logical(p, "data.train_inputs", std::move(tr->first), "data.train_targets", std::move(tr->second));
  if (!train) return train.err();
  p.train = std::move(train.value());
  const bool eval_keys = !d.eval_inputs.empty() || !d.eval_targets.empty();
  if (eval_keys) {
    auto ev = pair(eval_in, eval_tg);
    if (!ev) return ev.err();
    auto eval = add_logical(p, "data.eval_inputs", std::move(ev->first), "data.eval_targets", std::move(ev->second));
    if (!eval) return eval.err();
    p.eval = std::move(eval.value());
  } else if (auto st = hold_out(p, d.val_fraction, "data.train_inputs", "data.eval_inputs"); !st) {
    return st.err();
  }
  auto reader = open_reader(d.shards, p);
  if (!reader) return reader.err();
  // Rows: of the input shard; its target shard must say the same.
  auto rows = [&](const std::vector<std::vector<size_t>>& ks, const keyed_spec& in, const keyed_spec& tg) -> result<std::vector<int64_t>> {
    const std::string& in_key = in.key;
    auto a = records_of(*reader.value(), ks, in.key, in.spec);
    if (!a) return a.err();
    std::vector<std::vector<size_t>> targets;
    for (const auto& k : ks) targets.push_back({k[1]});
    auto b = records_of(*reader.value(), targets, tg.key, tg.spec);
    if (!b) return b.err();
    for (size_t i = 0; i < ks.size(); ++i)
      if (a.value()[i] != b.value()[i])
        return make_error(in_key + ": shard " + reader.value()->shards()[ks[i][0]].url + " holds " + std::to_string(a.value()[i]) + " rows, its target shard " +
                          reader.value()->shards()[ks[i][1]].url + " " + std::to_string(b.value()[i]) + ": paired shards must hold as many");
    return a;
  };
  auto train_n = rows(p.train, train_in, train_tg);
  if (!train_n) return train_n.err();
  auto eval_n = eval_keys ? rows(p.eval, eval_in, eval_tg) : rows(p.eval, train_in, train_tg);
  if (!eval_n) return eval_n.err();
  sharded_split out;
  out.reader = reader.value();
  out.train = std::make_shared<npy_shard_source>(out.reader, p.train, train_n.value());
  out.eval = std::make_shared<npy_shard_source>(out.reader, p.eval, eval_n.value());
  if (auto st = out.train->open_shard(0); !st) return make_error("data.train_inputs: " + st.message());
  return out;
}

}  // namespace dtactor
