// The CSV reader of examples/custom_task (examples/custom_task/csv_rows.hpp):
// the tabular task's data.train_csv / data.eval_csv. The first byte picks
// model.classes. Properties: parse_csv never crashes; rows it accepts have
// the same width, and every label is a class id.
#include <sstream>

#include "examples/custom_task/csv_rows.hpp"
#include "fuzz/fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int64_t classes = 1 + data[0] % 16;
  std::istringstream in(std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  auto rows = tabular::parse_csv(in, "fuzz.csv", classes);
  if (!rows) return 0;
  const auto& r = rows.value();
  if (r.columns < 2 || r.values.size() != r.labels.size() * (r.columns - 1)) dtactor::fuzz::fail("rows of different widths");
  for (int64_t l : r.labels)
    if (l < 0 || l >= classes) dtactor::fuzz::fail("a label that is not a class id");
  return 0;
}
