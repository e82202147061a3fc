// Job key files (base/job_key.hpp): `--key FILE` or DTACTOR_KEY_FILE on
// every process of a job; a hand-edited or damaged file must be refused in
// one line, never half-used. Properties: parse_job_key never crashes; a key
// it accepts has four 40-character Z85 CURVE keys whose public halves
// belong to their secret ones, and a 32-byte MAC key.
#include <zmq.h>

#include "fuzz/fuzz_util.hpp"
#include "base/job_key.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto k = parse_job_key(text, "fuzz.key");
  if (!k) {
    if (k.message().find("fuzz.key") == std::string::npos) fuzz::fail("an error that does not name the key file");
    return 0;
  }
  for (const std::string* z : {&k->server_public, &k->server_secret, &k->client_public, &k->client_secret})
    if (curve_key_binary(*z).size() != 32) fuzz::fail("an accepted key that is not Z85 CURVE");
  char derived[41];
  if (zmq_curve_public(derived, k->client_secret.c_str()) != 0 || k->client_public != derived) fuzz::fail("a client key pair that does not match");
  if (k->mac_key.size() != 32) fuzz::fail("a MAC key that is not 32 bytes");
  return 0;
}
