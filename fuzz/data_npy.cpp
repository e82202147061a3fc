// NumPy .npy files (data/npy.hpp), the data of a torchscript job (data.*
// paths, shards listed or globbed, local or fetched from S3): the header is
// a Python dict literal with a shape that may claim any size. Properties:
// parse_npy_header never crashes and accepts only headers whose shape and
// dtype match the file's size exactly; an opened array reads every sample
// inside the file (AddressSanitizer watches the mapping's bounds).
#include <algorithm>

#include "fuzz/fuzz_util.hpp"
#include "data/npy.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  // The header alone, against the real size and against sizes it may claim.
  for (uint64_t file_size : {uint64_t{size}, uint64_t{1} << 40, ~uint64_t{0}}) {
    auto h = parse_npy_header(bytes.substr(0, std::min<size_t>(size, 64 << 10)), file_size);
    if (!h) continue;
    if (h->shape.empty() || h->data_offset > file_size || h->data_bytes != file_size - h->data_offset)
      fuzz::fail("an accepted header does not describe the file");
  }
  fuzz::memory_file file(bytes);
  auto a = npy_array::open(file.path());
  if (!a) return 0;
  const uint64_t rows = static_cast<uint64_t>(a->rows());
  if (rows > 0 && a->row_bytes() > size) fuzz::fail("a sample larger than the file");
  uint64_t sum = 0;
  for (uint64_t i = 0; i < std::min<uint64_t>(rows, 4096); ++i) {
    const uint8_t* r = a->row(static_cast<int64_t>(i));
    for (size_t b = 0; b < a->row_bytes(); ++b) sum += r[b];
  }
  const uint64_t elements = rows * (a->row_bytes() / item_bytes(a->dtype()));
  for (uint64_t k = 0; k < std::min<uint64_t>(elements, 4096); ++k) sum += static_cast<uint64_t>(a->at(k) != 0);
  return static_cast<int>(sum & 0);
}
