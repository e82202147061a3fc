// The journal and the log book (job/journal_events.hpp,
// monitoring/report.hpp): `dtactor report RUN_DIR` reads journal.jsonl, a
// file any process of the run appends to and a user may edit or truncate.
// Properties: every line parses or is refused in one line; a journal that
// digests renders as Markdown and SVG without crashing.
#include <sstream>

#include "job/journal_events.hpp"
#include "fuzz/fuzz_util.hpp"
#include "monitoring/report.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    auto r = ev::read_journal_line(line);
    if (!r) {
      if (r.message().empty()) fuzz::fail("a refused line without a reason");
      continue;
    }
    if (r.value()) {
      // A line that reads writes back as JSON that reads as the same event.
      auto j = ev::to_json(r.value()->event);
      j["event"] = std::string(ev::name_of(r.value()->event));
      auto back = ev::from_json(j);
      if (!back) fuzz::fail("an event read from the journal does not read back");
    }
  }
  std::istringstream in(text);
  auto d = digest_journal(in, "journal.jsonl");
  if (!d) return 0;
  (void)render_loss_svg(d.value());
  (void)render_report(d.value(), "run", "[model]\nname = \"vit\"\n", "loss.svg");
  return 0;
}
