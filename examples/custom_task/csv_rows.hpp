#pragma once
// The CSV reader of the tabular task (main.cpp), without LibTorch: the rows
// of "x1,x2,...,label" as numbers, checked, from a stream or from a shard's
// bytes. Its own header so that the fuzz
// target (fuzz/custom_task_csv.cpp in dtactor's repository) reads CSV the
// way the task does.
#include <dtactor/result.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <istream>
#include <sstream>
#include <streambuf>
#include <string>
#include <string_view>
#include <vector>

namespace tabular {

struct csv_rows {
  std::vector<float> values;   // rows x (columns - 1), row-major
  std::vector<int64_t> labels;  // one per row
  size_t columns = 0;           // features + the label
};

// The comma-separated fields of `line` as numbers into `row`; false (and the
// first field that is not a number in `bad`) when one is not.
inline bool numbers_of(const std::string& line, std::vector<double>& row, std::string& bad) {
  std::stringstream fields(line);
  std::string field;
  while (std::getline(fields, field, ',')) {
    char* end = nullptr;
    double v = std::strtod(field.c_str(), &end);
    if (end == field.c_str() || *end != '\0') {
      bad = field;
      return false;
    }
    row.push_back(v);
  }
  return true;
}

// Reads "x1,x2,...,label" rows; a header line (anything not a number in the
// first field) is skipped. Every failure is one line naming `path` and the line.
inline dtactor::result<csv_rows> parse_csv(std::istream& in, const std::string& path, int64_t classes) {
  csv_rows out;
  size_t line_no = 0;
  std::string line;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    std::vector<double> row;
    std::string field;
    if (!numbers_of(line, row, field)) {
      if (line_no == 1) continue;  // a header
      return dtactor::make_error("'" + path + "' line " + std::to_string(line_no) + ": '" + field + "' is not a number");
    }
    if (row.size() < 2) return dtactor::make_error("'" + path + "' line " + std::to_string(line_no) + ": needs features and a label");
    if (out.columns == 0) out.columns = row.size();
    if (row.size() != out.columns)
      return dtactor::make_error("'" + path + "' line " + std::to_string(line_no) + ": " + std::to_string(row.size()) +
                                 " columns, the first row has " + std::to_string(out.columns));
    const double label = row.back();
    // The range first: converting a number outside int64_t (1e30, inf,
    // nan) to an integer is undefined behaviour (found by fuzzing).
    if (!(label >= 0 && label < static_cast<double>(classes)) || label != std::floor(label))
      return dtactor::make_error("'" + path + "' line " + std::to_string(line_no) + ": label " + std::to_string(label) +
                                 " is not a class id below model.classes (" + std::to_string(classes) + ")");
    for (size_t i = 0; i + 1 < row.size(); ++i) out.values.push_back(static_cast<float>(row[i]));
    out.labels.push_back(static_cast<int64_t>(label));
  }
  if (out.labels.empty()) return dtactor::make_error("'" + path + "' holds no rows");
  return out;
}

// parse_csv over bytes in memory (a shard's, mapped), without copying them.
inline dtactor::result<csv_rows> parse_csv_text(std::string_view text, const std::string& path, int64_t classes) {
  struct view_buf : std::streambuf {
    explicit view_buf(std::string_view t) {
      char* p = const_cast<char*>(t.data());  // only read: std::streambuf's get area is char*
      setg(p, p, p + t.size());
    }
  } buf(text);
  std::istream in(&buf);
  return parse_csv(in, path, classes);
}

// Whether parse_csv takes the first line of `text` for a header (a field
// that is not a number). A CSV shard's rows are its lines, less this one.
inline bool has_header(std::string_view text) {
  const std::string first(text.substr(0, text.find('\n')));
  std::vector<double> row;
  std::string bad;
  return !first.empty() && !numbers_of(first, row, bad);
}

}  // namespace tabular
