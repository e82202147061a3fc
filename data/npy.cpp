#include "data/npy.hpp"


#include <cstring>
#include <algorithm>
#include <limits>

namespace dtactor {

namespace {

constexpr std::string_view magic{"\x93NUMPY", 6};

struct dtype_info {
  const char* descr;  // without the byte-order character
  npy_dtype type;
  const char* name;
  std::size_t bytes;
};

constexpr dtype_info dtypes[] = {
    {"b1", npy_dtype::b1, "bool", 1},    {"u1", npy_dtype::u1, "uint8", 1},   {"i1", npy_dtype::i1, "int8", 1},
    {"u2", npy_dtype::u2, "uint16", 2},  {"i2", npy_dtype::i2, "int16", 2},   {"u4", npy_dtype::u4, "uint32", 4},
    {"i4", npy_dtype::i4, "int32", 4},   {"u8", npy_dtype::u8, "uint64", 8},  {"i8", npy_dtype::i8, "int64", 8},
    {"f2", npy_dtype::f2, "float16", 2}, {"f4", npy_dtype::f4, "float32", 4}, {"f8", npy_dtype::f8, "float64", 8},
};

const dtype_info& info(npy_dtype t) {
  for (const auto& d : dtypes)
    if (d.type == t) return d;
  return dtypes[0];
}

uint64_t le(std::string_view b, std::size_t at, std::size_t n) {
  uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[at + i])) << (8 * i);
  return v;
}

// The value of 'key' in the dict literal: the text after "'key':" up to the
// next top-level ',' or '}' (a tuple's commas are inside parentheses).
std::string_view value_of(std::string_view dict, std::string_view key) {
  for (const char q : {'\'', '"'}) {
    const std::string k = std::string(1, q) + std::string(key) + std::string(1, q);
    auto at = dict.find(k);
    if (at == std::string_view::npos) continue;
    at = dict.find(':', at + k.size());
    if (at == std::string_view::npos) return {};
    ++at;
    int depth = 0;
    std::size_t end = at;
    for (; end < dict.size(); ++end) {
      const char c = dict[end];
      if (c == '(' || c == '[') ++depth;
      else if ((c == ')' || c == ']') && depth > 0) --depth;
      else if ((c == ',' || c == '}') && depth == 0) break;
    }
    std::string_view v = dict.substr(at, end - at);
    while (!v.empty() && (v.front() == ' ')) v.remove_prefix(1);
    while (!v.empty() && (v.back() == ' ')) v.remove_suffix(1);
    return v;
  }
  return {};
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) bits = sign;
    else {  // subnormal: normalise
      exp = 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace

const char* to_string(npy_dtype t) { return info(t).name; }
std::size_t item_bytes(npy_dtype t) { return info(t).bytes; }

namespace {

// The header dict's dtype ('descr': '<f4', '|u1', ...): a supported one,
// little-endian (or single-byte).
result<const dtype_info*> parse_descr(std::string_view dict) {
  auto descr = value_of(dict, "descr");
  if (descr.size() < 2 || (descr.front() != '\'' && descr.front() != '"') || descr.back() != descr.front())
    return make_error("the .npy header has no dtype ('descr')");
  descr = descr.substr(1, descr.size() - 2);
  if (descr.size() != 3) return make_error("dtype '" + std::string(descr) + "' is not supported (numbers and bool only: uint8..int64, float16/32/64, bool)");
  const char order = descr[0];
  const dtype_info* found = nullptr;
  for (const auto& d : dtypes)
    if (descr.substr(1) == d.descr) found = &d;
  if (!found) return make_error("dtype '" + std::string(descr) + "' is not supported (numbers and bool only: uint8..int64, float16/32/64, bool)");
  if (order == '>' && found->bytes > 1) return make_error("dtype '" + std::string(descr) + "' is big-endian; save it little-endian (astype('<" + found->descr + "'))");
  if (order != '<' && order != '|' && order != '=' && order != '>') return make_error("dtype '" + std::string(descr) + "' has an unknown byte order");
  return found;
}

// The header dict's 'shape' tuple, appended to `dims`: the element count
// (every dimension and the product within 64 bits).
result<uint64_t> parse_shape(std::string_view dict, std::vector<int64_t>& dims) {
  auto shape = value_of(dict, "shape");
  if (shape.size() < 2 || shape.front() != '(' || shape.back() != ')') return make_error("the .npy header has no 'shape' tuple");
  shape = shape.substr(1, shape.size() - 2);
  uint64_t elements = 1;
  std::size_t i = 0;
  while (i < shape.size()) {
    while (i < shape.size() && (shape[i] == ' ' || shape[i] == ',')) ++i;
    if (i >= shape.size()) break;
    uint64_t v = 0;
    std::size_t digits = 0;
    while (i < shape.size() && shape[i] >= '0' && shape[i] <= '9') {
      if (v > (std::numeric_limits<uint64_t>::max() - 9) / 10) return make_error("a .npy dimension is too large");
      v = v * 10 + static_cast<uint64_t>(shape[i] - '0');
      ++i;
      ++digits;
    }
    if (digits == 0) return make_error("the .npy shape '(" + std::string(shape) + ")' is not a tuple of sizes");
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return make_error("a .npy dimension is too large");
    dims.push_back(static_cast<int64_t>(v));
    if (v != 0 && elements > std::numeric_limits<uint64_t>::max() / v) return make_error("the .npy shape is too large");
    elements *= v;
  }
  return elements;
}

}  // namespace

result<npy_header> parse_npy_header(std::string_view b, uint64_t file_size) {
  if (b.size() < 10 || b.substr(0, 6) != magic) return make_error("not a .npy file (no \\x93NUMPY magic)");
  const int major = static_cast<uint8_t>(b[6]);
  if (major < 1 || major > 3) return make_error(".npy format version " + std::to_string(major) + " is not supported (1, 2 and 3 are)");
  const std::size_t len_bytes = major == 1 ? 2 : 4;
  if (b.size() < 8 + len_bytes) return make_error("the .npy header is cut short");
  const uint64_t header_len = le(b, 8, len_bytes);
  npy_header h;
  h.data_offset = 8 + len_bytes + static_cast<std::size_t>(header_len);
  if (h.data_offset > file_size) return make_error("the .npy header claims " + std::to_string(header_len) + " bytes; the file is shorter");
  if (h.data_offset > b.size()) return make_error("the .npy header is over 64 KiB");
  const std::string_view dict = b.substr(8 + len_bytes, static_cast<std::size_t>(header_len));
  if (dict.find('{') == std::string_view::npos) return make_error("the .npy header is not a dict");

  auto found = parse_descr(dict);
  if (!found) return found.err();
  h.dtype = found.value()->type;

  const auto fortran = value_of(dict, "fortran_order");
  if (fortran == "True") return make_error("the array is stored in Fortran order; save np.ascontiguousarray(a) instead");
  if (fortran != "False") return make_error("the .npy header has no 'fortran_order'");

  auto elements = parse_shape(dict, h.shape);
  if (!elements) return elements.err();
  if (h.shape.empty()) return make_error("the array is a scalar; the first axis must be the samples");
  if (elements.value() > std::numeric_limits<uint64_t>::max() / found.value()->bytes) return make_error("the .npy shape is too large");
  h.data_bytes = elements.value() * found.value()->bytes;
  const uint64_t have = file_size - h.data_offset;
  if (have != h.data_bytes)
    return make_error("the header says " + std::to_string(h.data_bytes) + " bytes of data (shape and dtype), the file holds " + std::to_string(have) +
                      (have < h.data_bytes ? " (truncated?)" : ""));
  return h;
}

result<npy_array> npy_array::open(const std::string& path) {
  auto file = mapped_file::open(path);
  if (!file) return file.err();
  npy_array a;
  a.path_ = path;
  a.file_ = std::move(file.value());
  const std::string_view bytes(reinterpret_cast<const char*>(a.file_.data()), std::min<std::size_t>(a.file_.size(), std::size_t{64} << 10));
  auto h = parse_npy_header(bytes, a.file_.size());
  if (!h) return make_error("'" + path + "': " + h.message());
  a.header_ = std::move(h.value());
  a.data_ = a.file_.data() + a.header_.data_offset;
  uint64_t per_row = item_bytes(a.header_.dtype);
  for (std::size_t d = 1; d < a.header_.shape.size(); ++d) per_row *= static_cast<uint64_t>(a.header_.shape[d]);
  a.row_bytes_ = static_cast<std::size_t>(per_row);
  a.file_.advise_random();  // samples are read in a shuffled order: no read-ahead
  return a;
}

double npy_array::at(uint64_t k) const {
  const uint8_t* p = data_ + k * item_bytes(header_.dtype);
  auto get = [p](auto v) {
    std::memcpy(&v, p, sizeof v);
    return static_cast<double>(v);
  };
  switch (header_.dtype) {
    case npy_dtype::b1:
      return *p != 0 ? 1.0 : 0.0;
    case npy_dtype::u1:
      return get(uint8_t{});
    case npy_dtype::i1:
      return get(int8_t{});
    case npy_dtype::u2:
      return get(uint16_t{});
    case npy_dtype::i2:
      return get(int16_t{});
    case npy_dtype::u4:
      return get(uint32_t{});
    case npy_dtype::i4:
      return get(int32_t{});
    case npy_dtype::u8:
      return get(uint64_t{});
    case npy_dtype::i8:
      return get(int64_t{});
    case npy_dtype::f2: {
      uint16_t h;
      std::memcpy(&h, p, sizeof h);
      return half_to_float(h);
    }
    case npy_dtype::f4:
      return get(float{});
    case npy_dtype::f8:
      return get(double{});
  }
  return 0;
}

// ---- token_file ----

result<token_file> token_file::open(const std::string& path, uint32_t vocab_size, uint64_t min_tokens) {
  auto fail = [&](const std::string& why) { return make_error("'" + path + "': " + why); };
  auto file = mapped_file::open(path);
  if (!file) return file.err();
  const uint64_t size = file->size();
  if (size % 2 != 0) return fail("holds " + std::to_string(size) + " bytes, an odd number: not a stream of uint16 token ids");
  min_tokens = std::max<uint64_t>(min_tokens, 1);
  if (size / 2 < min_tokens)
    return fail("holds " + std::to_string(size / 2) + " tokens; at least " + std::to_string(min_tokens) + " are needed (one window of model.context + 1)");
  token_file t;
  t.path_ = path;
  t.file_ = std::move(file.value());
  t.tokens_ = size / 2;
  // One pass over the ids now, so a wrong vocabulary is a clear error at the
  // start, not an index error in the middle of training.
  t.file_.advise_sequential();
  for (uint64_t i = 0; i < t.tokens_; ++i)
    if (t.at(i) >= vocab_size)
      return fail("token id " + std::to_string(t.at(i)) + " at position " + std::to_string(i) + " is outside the model's vocabulary of " +
                  std::to_string(vocab_size));
  t.file_.advise_random();
  return t;
}

uint16_t token_file::at(uint64_t i) const {
  const uint8_t* p = file_.data() + 2 * i;
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}

void token_file::window(uint64_t start, uint64_t n, std::vector<int64_t>& out) const {
  out.resize(static_cast<std::size_t>(n));
  for (uint64_t k = 0; k < n; ++k) out[static_cast<std::size_t>(k)] = at(start + k);
}

}  // namespace dtactor
