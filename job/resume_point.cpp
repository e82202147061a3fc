#include "job/resume_point.hpp"

#include <algorithm>
#include <utility>

#include "data/sample_log.hpp"

namespace dtactor {

result<std::optional<resume_point>> find_resume_point(const resume_request& request, checkpoint_store& store, const resume_reports& reports) {
  if (!request.resume_from.empty()) {
    auto one = open_checkpoint_target(request.resume_from, {});
    if (!one) return make_error("cannot resume from '" + request.resume_from + "': " + one.message());
    return std::optional<resume_point>(resume_point{std::move(one->meta), one->name, one->store});
  }
  if (!request.resume) return std::optional<resume_point>();
  auto newest = store.newest_valid(
      [&](const std::string& path, const std::string& why) {
        if (reports.log) reports.log("skipping checkpoint " + path + ": " + why);
        ev::checkpoint_skipped skipped;
        skipped.path = path;
        skipped.reason = why;
        if (reports.journal) reports.journal(skipped);
      },
      true);
  if (!newest) return newest.err();
  if (!newest.value()) return std::optional<resume_point>();
  resume_point p;
  p.meta = std::move(*newest.value());
  p.path = store.location() + "/" + manifest_name(p.meta.step());
  p.from = std::make_shared<checkpoint_store>(store);
  return std::optional<resume_point>(std::move(p));
}

result<uint64_t> generations_before(checkpoint_store& store, const std::string& sample_log_dir) {
  auto logged = newest_logged_generation(sample_log_dir);
  if (!logged) return logged.err();
  return std::max(store.newest_generation(), logged.value());
}

}  // namespace dtactor
