#pragma once
// A job's key material (docs/security.md). One file, written by
// `dtactor keygen`, readable by its owner only (mode 0600), held by every
// process of the job:
//   - a CURVE keypair for the servers (the coordinator's ROUTER, the
//     rendezvous store, a node's ROUTER for its ranks): clients pin its
//     public half, so a client talks only to a holder of the job's key;
//   - a CURVE keypair shared by every client (nodes, ranks, store clients):
//     the servers' ZAP handler admits this public key and no other;
//   - a 32-byte MAC key for checkpoint manifests (HMAC-SHA256).
// Every process of a job holds every secret: the job's members trust each
// other; the key keeps everyone else out.
//
// File format (text, one "name = value" per line, '#' comments):
//   server_public = <Z85, 40 chars>   server_secret = <Z85, 40 chars>
//   client_public = <Z85, 40 chars>   client_secret = <Z85, 40 chars>
//   mac_key = <hex, 64 chars>
#include <memory>
#include <string>

#include "dtactor/result.hpp"

namespace dtactor {

struct job_key {
  std::string server_public, server_secret;  // Z85 text, 40 characters
  std::string client_public, client_secret;  // Z85 text, 40 characters
  std::string mac_key;                       // 32 raw bytes
};

// The environment variable a process reads its key file from when no --key
// is given (`dtactor local` and node agents set it for their children).
inline constexpr const char* key_file_env = "DTACTOR_KEY_FILE";

// True when this libzmq can do CURVE (built with libsodium).
bool curve_available();

// Fresh keys: CURVE keypairs from libzmq, the MAC key from OpenSSL's RAND_bytes.
result<job_key> generate_job_key();
// Writes `key` to `path` with mode 0600; refuses to overwrite an existing file.
status write_job_key(const std::string& path, const job_key& key);
// Reads and checks a key file; refuses one whose mode has any group or
// other permission bit ("chmod 600 FILE"), or a malformed one. Errors are
// one line naming the file.
result<job_key> load_job_key(const std::string& path);

// The checks of load_job_key on a key file's text (`path` names it in
// errors); pure, for the fuzz target (fuzz/job_key.cpp) and tests.
result<job_key> parse_job_key(const std::string& text, const std::string& path);

// The 32-byte binary form of a Z85 CURVE key (empty when malformed).
std::string curve_key_binary(const std::string& z85);

// HMAC-SHA256 of `data` under `key`: 32 raw bytes.
std::string hmac_sha256(const std::string& key, const std::string& data);
// Constant-time comparison of two byte strings of the same length.
bool equal_constant_time(const std::string& a, const std::string& b);

// The key named by `cli_path`, else by DTACTOR_KEY_FILE, else none (null).
// On success with a key, DTACTOR_KEY_FILE is set to the file's absolute path
// so that the processes this one starts use the same key.
result<std::shared_ptr<const job_key>> resolve_job_key(const std::string& cli_path);

}  // namespace dtactor
