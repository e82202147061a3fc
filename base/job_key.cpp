#include "base/job_key.hpp"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <map>
#include <cstdio>
#include <tuple>
#include <zmq.h>

namespace dtactor {

namespace {

constexpr std::size_t z85_key_chars = 40;
constexpr std::size_t mac_key_bytes = 32;
constexpr off_t max_key_file_bytes = 64 << 10;

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

bool from_hex(const std::string& hex, std::string& out) {
  if (hex.size() % 2) return false;
  out.clear();
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (std::size_t i = 0; i < hex.size(); i += 2) {
    int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out += static_cast<char>(hi * 16 + lo);
  }
  return true;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

}  // namespace

bool curve_available() { return zmq_has("curve") != 0; }

std::string curve_key_binary(const std::string& z85) {
  if (z85.size() != z85_key_chars) return "";
  std::string out(32, '\0');
  if (!zmq_z85_decode(reinterpret_cast<uint8_t*>(out.data()), z85.c_str())) return "";
  return out;
}

result<job_key> generate_job_key() {
  if (!curve_available())
    return make_error("this libzmq has no CURVE support (built without libsodium): install Debian's libzmq5, which has it");
  job_key k;
  char pub[41], sec[41];
  if (zmq_curve_keypair(pub, sec) != 0) return make_error(std::string("cannot make a CURVE keypair: ") + zmq_strerror(zmq_errno()));
  k.server_public = pub;
  k.server_secret = sec;
  if (zmq_curve_keypair(pub, sec) != 0) return make_error(std::string("cannot make a CURVE keypair: ") + zmq_strerror(zmq_errno()));
  k.client_public = pub;
  k.client_secret = sec;
  k.mac_key.assign(mac_key_bytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(k.mac_key.data()), static_cast<int>(mac_key_bytes)) != 1)
    return make_error("cannot draw random bytes for the MAC key (OpenSSL RAND_bytes failed)");
  OPENSSL_cleanse(sec, sizeof sec);
  return k;
}

status write_job_key(const std::string& path, const job_key& key) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno == EEXIST) return make_error("key file '" + path + "' already exists: remove it first or choose another --out");
    return make_error("cannot create key file '" + path + "': " + std::strerror(errno));
  }
  // The umask may have removed bits, never added them; make sure anyway.
  ::fchmod(fd, 0600);
  std::string text =
      "# dtactor job key (docs/security.md). Secret: every process of the job reads it; keep it mode 0600.\n"
      "server_public = " + key.server_public + "\nserver_secret = " + key.server_secret + "\nclient_public = " + key.client_public +
      "\nclient_secret = " + key.client_secret + "\nmac_key = " + to_hex(key.mac_key) + "\n";
  std::size_t done = 0;
  while (done < text.size()) {
    const auto n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      ::unlink(path.c_str());
      return make_error("cannot write key file '" + path + "': " + why);
    }
    done += static_cast<std::size_t>(n);
  }
  OPENSSL_cleanse(text.data(), text.size());
  if (::fsync(fd) != 0 || ::close(fd) != 0) return make_error("cannot write key file '" + path + "': " + std::strerror(errno));
  return status::success();
}

result<job_key> load_job_key(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return make_error("key file '" + path + "': " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return make_error("key file '" + path + "' is not a regular file");
  if (st.st_mode & 077) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return make_error("key file '" + path + "' has mode " + mode + ", readable beyond its owner: run chmod 600 '" + path + "'");
  }
  // A key file is a few hundred bytes: anything much larger is not one
  // (and is not read into memory whole).
  if (st.st_size > max_key_file_bytes) return make_error("key file '" + path + "' is not a dtactor key file (too long)");
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error("key file '" + path + "': cannot open it");
  std::string text(static_cast<size_t>(st.st_size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  return parse_job_key(text, path);
}

result<job_key> parse_job_key(const std::string& text, const std::string& path) {
  std::istringstream in(text);
  std::map<std::string, std::string> kv;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (number > 100 || line.size() > 1000) return make_error("key file '" + path + "' is not a dtactor key file (too long)");
    line = trim(line);
    if (line.empty() || line[0] == '#') continue;
    const auto eq = line.find('=');
    if (eq == std::string::npos)
      return make_error("key file '" + path + "', line " + std::to_string(number) + ": expected name = value (make one with dtactor keygen)");
    kv[trim(line.substr(0, eq))] = trim(line.substr(eq + 1));
  }
  job_key k;
  for (auto [name, field] : {std::pair{"server_public", &k.server_public}, {"server_secret", &k.server_secret},
                             {"client_public", &k.client_public}, {"client_secret", &k.client_secret}}) {
    auto it = kv.find(name);
    if (it == kv.end()) return make_error("key file '" + path + "' has no " + name + " (make one with dtactor keygen)");
    if (curve_key_binary(it->second).empty())
      return make_error("key file '" + path + "': " + name + " is not a 40-character Z85 CURVE key");
    *field = it->second;
  }
  auto mac = kv.find("mac_key");
  if (mac == kv.end()) return make_error("key file '" + path + "' has no mac_key (make one with dtactor keygen)");
  if (!from_hex(mac->second, k.mac_key) || k.mac_key.size() != mac_key_bytes)
    return make_error("key file '" + path + "': mac_key is not 64 hex digits");
  // The public halves must belong to the secret ones: a hand-edited file
  // would otherwise fail later as an unexplained handshake refusal.
  for (auto [pub, sec, name] : {std::tuple{&k.server_public, &k.server_secret, "server"}, {&k.client_public, &k.client_secret, "client"}}) {
    char derived[41];
    if (zmq_curve_public(derived, sec->c_str()) != 0 || *pub != derived)
      return make_error("key file '" + path + "': " + name + "_public does not belong to " + name + "_secret");
  }
  return k;
}

std::string hmac_sha256(const std::string& key, const std::string& data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &len);
  return std::string(reinterpret_cast<char*>(out), len);
}

bool equal_constant_time(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

result<std::shared_ptr<const job_key>> resolve_job_key(const std::string& cli_path) {
  std::string path = cli_path;
  if (path.empty())
    if (const char* env = std::getenv(key_file_env); env && *env) path = env;
  if (path.empty()) return std::shared_ptr<const job_key>();
  auto k = load_job_key(path);
  if (!k) return k.err();
  if (!curve_available()) return make_error("a job key needs CURVE, and this libzmq has none (built without libsodium)");
  std::error_code ec;
  const auto abs = std::filesystem::absolute(path, ec);
  ::setenv(key_file_env, ec ? path.c_str() : abs.c_str(), 1);
  return std::shared_ptr<const job_key>(std::make_shared<job_key>(std::move(k.value())));
}

}  // namespace dtactor
