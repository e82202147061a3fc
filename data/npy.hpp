#pragma once
// NumPy .npy arrays, read in place: the header is checked against the file
// (a header that lies about the size is an error, never a short read), the
// data is memory-mapped read-only and never copied whole into memory. The
// first axis is the samples axis. No LibTorch here.
//
// Format (numpy.lib.format): "\x93NUMPY", major, minor, a little-endian
// header length (2 bytes for 1.0, 4 for 2.0 and 3.0), an ASCII/UTF-8 Python
// dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (n, ...), }
// padded to a multiple of 64 bytes, then the C-order data.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "storage/fs.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

// The dtypes NumPy writes for numbers (little-endian or single-byte).
enum class npy_dtype { b1, u1, i1, u2, i2, u4, i4, u8, i8, f2, f4, f8 };

const char* to_string(npy_dtype t);  // NumPy's name: "uint8", "float32", ...
std::size_t item_bytes(npy_dtype t);

struct npy_header {
  npy_dtype dtype = npy_dtype::f4;
  std::vector<int64_t> shape;   // at least one axis
  std::size_t data_offset = 0;  // where the data starts
  uint64_t data_bytes = 0;      // product of the shape times the item size
};

// Parses the header at the start of `bytes` (at most the first 64 KiB are
// read; pass at least that much, or the whole file when it is shorter) of a
// file of `file_size` bytes. One clear line on anything else: not .npy, an
// unknown version, a dtype it does not support (big-endian, strings,
// objects, complex), Fortran order, a scalar, a size that does not match
// the file.
result<npy_header> parse_npy_header(std::string_view bytes, uint64_t file_size);

// A memory-mapped .npy file.
class npy_array {
 public:
  // Errors name the file: "'x.npy': not a .npy file (no \x93NUMPY magic)".
  static result<npy_array> open(const std::string& path);

  const std::string& path() const { return path_; }
  npy_dtype dtype() const { return header_.dtype; }
  const std::vector<int64_t>& shape() const { return header_.shape; }
  int64_t rows() const { return header_.shape[0]; }
  // Bytes of one sample (the product of the other axes times the item size).
  std::size_t row_bytes() const { return row_bytes_; }
  // The raw little-endian bytes of sample i (0 <= i < rows()).
  const uint8_t* row(int64_t i) const { return data_ + static_cast<std::size_t>(i) * row_bytes_; }
  // Element `k` of the flattened array, converted to double (any dtype).
  double at(uint64_t k) const;

 private:
  std::string path_;
  npy_header header_;
  std::size_t row_bytes_ = 0;
  mapped_file file_;
  const uint8_t* data_ = nullptr;
};

}  // namespace dtactor

namespace dtactor {

// A token stream in nanoGPT's .bin format (data/shakespeare_char/prepare.py):
// flat little-endian uint16 token ids, memory-mapped read-only. Checked
// when opened: an even size, at least `min_tokens` tokens, and every id
// below `vocab_size` (one clear line with the first offending position).
class token_file {
 public:
  static result<token_file> open(const std::string& path, uint32_t vocab_size, uint64_t min_tokens = 2);

  const std::string& path() const { return path_; }
  uint64_t size() const { return tokens_; }
  uint16_t at(uint64_t i) const;  // 0 <= i < size()
  // The window of `n` tokens starting at `start` (start + n <= size()).
  void window(uint64_t start, uint64_t n, std::vector<int64_t>& out) const;

 private:
  std::string path_;
  mapped_file file_;
  uint64_t tokens_ = 0;
};

}  // namespace dtactor
