// Checkpoint manifests (storage/checkpoint_store.hpp): read at every resume,
// eval and export from a directory or an S3 prefix that others may write
// (a shared bucket, a planted file). Input: records; the first is the
// manifest's bytes (stored as ckpt-000000007.manifest), the next ones more
// objects ("name\0bytes": parts, other manifests). Flag bits of the first
// record's tag: 1 signs manifests with a job key (a MAC is then required),
// 2 makes the store claim the manifest is 2^40 bytes (a lying S3
// Content-Length, a sparse file). Properties: reading, verifying and
// listing never crash and never allocate what a size field claims; a
// manifest that reads commits again (encode) and reads back the same.
#include "fuzz/fuzz_util.hpp"
#include "fuzz/memory_store.hpp"
#include "storage/checkpoint_store.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::reader in(data, size);
  const uint8_t flags = in.u8();
  const std::string manifest = in.payload();
  auto objects = std::make_shared<fuzz::memory_store>();
  const std::string name = manifest_name(7);
  objects->objects[name] = manifest;
  if (flags & 2) objects->claimed_size[name] = uint64_t{1} << 40;
  while (!in.empty()) {
    (void)in.u8();
    const std::string rec = in.payload();
    const auto nul = rec.find('\0');
    if (nul == std::string::npos || nul == 0) continue;
    objects->objects[rec.substr(0, nul)] = rec.substr(nul + 1);
  }
  set_checkpoint_mac_key(flags & 1 ? std::string(32, 'k') : std::string());
  auto store = checkpoint_store::over(objects, checkpoint_policy{});
  auto meta = store.read_manifest(name);
  if (meta) {
    (void)store.verify(meta.value(), true);
    // What a coordinator does with the checkpoint it resumes from: commit
    // the next one through the same encoder.
    pb::checkpoint_meta next = meta.value();
    next.set_step(8);
    if (auto saved = store.commit(next)) {
      auto back = store.read_manifest(manifest_name(8));
      if (!back) fuzz::fail("a committed manifest does not read back");
      next.set_format_version(checkpoint_format_version);
      if (!fuzz::same_message(next, back.value())) fuzz::fail("a committed manifest reads back different");
    }
  }
  (void)store.newest_valid([](const std::string&, const std::string&) {}, true);
  (void)store.list();
  set_checkpoint_mac_key("");
  return 0;
}
