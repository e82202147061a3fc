// IDX image and label files (model/idx.hpp), the format of Fashion-MNIST
// (Debian's dataset-fashion-mnist, or data.fashion_mnist_dir): after gzip,
// a big-endian header whose axis sizes say how many bytes follow. Input:
// two records, the images file and the labels file as decompressed.
// Properties: check_idx_pair never crashes, and a pair it accepts holds
// exactly the bytes its header claims (what the tensors are made from).
#include "fuzz/fuzz_util.hpp"
#include "model/idx.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::reader in(data, size);
  (void)in.u8();
  const std::string images = in.payload();
  (void)in.u8();
  const std::string labels = in.payload();
  const std::vector<uint8_t> ib(images.begin(), images.end()), lb(labels.begin(), labels.end());
  auto shape = check_idx_pair(ib, "images.gz", lb, "labels.gz");
  if (!shape) return 0;
  const unsigned __int128 pixels = static_cast<unsigned __int128>(shape->images) * static_cast<unsigned __int128>(shape->rows) *
                                   static_cast<unsigned __int128>(shape->cols);
  if (pixels != ib.size() - 16 || static_cast<uint64_t>(shape->images) != lb.size() - 8) fuzz::fail("an accepted IDX pair whose header claims other sizes");
  return 0;
}
