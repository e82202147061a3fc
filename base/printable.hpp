#pragma once
// Text from outside (a peer's node id, reason, path, error; anything this
// process did not write itself) made safe for a log line, the journal, the
// status page or a metric label: one line of printable characters, of
// bounded length. The one escaping function: every place that prints peer
// text goes through it (docs/security.md).
#include <cstddef>
#include <string>
#include <string_view>

namespace dtactor {

// Characters of peer text shown before the cut: enough for a host name, a
// pod name, a path or an error message; a 10 KB id becomes one short line.
constexpr std::size_t printable_max_chars = 128;
// For a peer's error message or failure detail, which may rightly be longer.
constexpr std::size_t printable_max_detail_chars = 512;

// `text` as one printable line: control bytes (newline, ESC, NUL, DEL) and
// every byte of invalid UTF-8 as \xNN;
// C1 controls, the bidirectional overrides and U+2028/U+2029 (which reorder
// or break a line on a terminal or a page) as \u{XXXX}; any other UTF-8 as
// it is. A backslash stays a backslash (so the result of printable() passes
// through it again unchanged, as long as it is not cut). Beyond `max_chars`
// output characters the text is cut, and "...(N bytes)" (N: the whole
// input's size) follows; max_chars 0 means no cut.
std::string printable(std::string_view text, std::size_t max_chars = printable_max_chars);

}  // namespace dtactor
