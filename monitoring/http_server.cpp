#include "monitoring/http_server.hpp"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <civetweb.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "base/async_log.hpp"

// civetweb's Debian build asks for 100 KiB thread stacks (its compile-time
// USE_STACK_SIZE), less than the static TLS of a process that links
// LibTorch (a program on the C++ API that runs the coordinator or a node in
// its own process): pthread_create then fails with EINVAL and no worker
// starts. A request below what the loaded objects' static TLS needs plus
// 256 KiB is raised to that; every other request passes unchanged.
namespace {

int add_tls(dl_phdr_info* info, size_t, void* total) {
  for (int i = 0; i < info->dlpi_phnum; ++i)
    if (info->dlpi_phdr[i].p_type == PT_TLS) *static_cast<size_t*>(total) += info->dlpi_phdr[i].p_memsz;
  return 0;
}

size_t smallest_stack() {
  static const size_t floor = [] {
    size_t tls = 0;
    dl_iterate_phdr(add_tls, &tls);
    return tls + 256 * 1024;
  }();
  return floor;
}

}  // namespace

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  using fn = int (*)(pthread_attr_t*, size_t);
  static const fn real = reinterpret_cast<fn>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  if (!real) return ENOSYS;
  return real(attr, size < smallest_stack() ? smallest_stack() : size);
}

// civetweb 1.15's master thread polls its listening sockets and, when
// accept() fails, polls again at once. Out of file descriptors (EMFILE,
// ENFILE) the waiting connection stays, poll() returns at once, and the
// thread spins a core until a descriptor frees. An accept() that fails for
// want of descriptors therefore waits 50 ms before it returns: 20 tries a
// second instead of a spin. Every other call passes unchanged; libzmq calls
// accept4(), which this leaves alone.
namespace {
std::atomic<uint64_t> accepts_without_descriptors{0};
}  // namespace

extern "C" int accept(int fd, sockaddr* addr, socklen_t* len) {
  using fn = int (*)(int, sockaddr*, socklen_t*);
  static const fn real = reinterpret_cast<fn>(dlsym(RTLD_NEXT, "accept"));
  if (!real) {
    errno = ENOSYS;
    return -1;
  }
  const int r = real(fd, addr, len);
  if (r < 0 && (errno == EMFILE || errno == ENFILE)) {
    const int e = errno;
    if (accepts_without_descriptors.fetch_add(1) == 0)
      dtactor::stderr_line("dtactor: http: out of file descriptors, connections wait (raise ulimit -n)");
    ::usleep(50 * 1000);
    errno = e;
  }
  return r;
}

namespace dtactor {

uint64_t http_accepts_without_descriptors() { return accepts_without_descriptors.load(); }

struct http_server::impl {
  http_handler handler;
  mg_context* ctx = nullptr;
  ~impl() {
    if (ctx) mg_stop(ctx);  // joins every worker: no handler runs after this
  }
};

namespace {

const char* reason_phrase(int status) {
  switch (status) {
    case 200: return "OK";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    default: return "Error";
  }
}

// civetweb's request handler: one reply, then the connection closes.
int on_request(mg_connection* conn, void* cbdata) {
  const auto& handler = static_cast<http_server::impl*>(cbdata)->handler;
  const mg_request_info* ri = mg_get_request_info(conn);
  const std::string method = ri && ri->request_method ? ri->request_method : "";
  const std::string path = ri && ri->local_uri ? ri->local_uri : "";
  http_response r;
  try {
    r = handler(method, path);
  } catch (const std::exception&) {
    r = {500, "text/plain; charset=utf-8", "internal error\n"};
  }
  std::string head = "HTTP/1.1 " + std::to_string(r.status) + " " + reason_phrase(r.status) + "\r\nContent-Type: " + r.content_type +
                     "\r\nContent-Length: " + std::to_string(r.body.size()) + "\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n";
  mg_write(conn, head.data(), head.size());
  if (method != "HEAD") mg_write(conn, r.body.data(), r.body.size());
  return static_cast<int>(r.status);
}

// civetweb's own messages (a client that went away, a bad request) are
// about clients, not about the job: not printed.
int quiet(const mg_connection*, const char*) { return 1; }

std::once_flag library_once;

// Why host:port cannot be bound ("" when it can): civetweb's own message
// says only that it failed.
std::string bind_problem(in_addr host, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::strerror(errno);
  int yes = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr = host;
  std::string why;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    const int err = errno;
    why = std::strerror(err);
    if (err == EADDRINUSE) why += " (choose another metrics port, or 0 for none)";
  }
  ::close(fd);
  return why;
}

}  // namespace

result<std::unique_ptr<http_server>> http_server::start(const std::string& host, int port, http_handler handler, http_limits limits) {
  const std::string address = host + ":" + std::to_string(port);
  auto fail = [&](const std::string& why) -> result<std::unique_ptr<http_server>> { return make_error(address + ": " + why); };
  in_addr parsed{};
  if (::inet_pton(AF_INET, host.c_str(), &parsed) != 1) return fail("'" + host + "' is not an IPv4 address (use 0.0.0.0 for all interfaces)");
  if (port < 0 || port > 65535) return fail("the port must be 1..65535 (0: a free one)");
  if (auto why = bind_problem(parsed, port); !why.empty()) return fail(why);
  std::call_once(library_once, [] { mg_init_library(0); });

  std::unique_ptr<http_server> s(new http_server());
  s->impl_ = std::make_unique<impl>();
  s->impl_->handler = std::move(handler);
  const std::string workers = std::to_string(limits.workers), timeout = std::to_string(limits.request_timeout_ms),
                    max_request = std::to_string(limits.max_request_bytes);
  const char* options[] = {"listening_ports", address.c_str(), "num_threads", workers.c_str(), "request_timeout_ms", timeout.c_str(),
                           "max_request_size", max_request.c_str(), "enable_keep_alive", "no", "linger_timeout_ms", "0", nullptr};
  mg_callbacks callbacks{};
  callbacks.log_message = quiet;
  mg_init_data init{&callbacks, nullptr, options};
  char text[256] = {0};
  unsigned code = 0;
  mg_error_data error{&code, text, sizeof text};
  s->impl_->ctx = mg_start2(&init, &error);
  if (!s->impl_->ctx) {
    return fail(std::string("civetweb: ") + (text[0] ? text : "could not start"));
  }
  mg_set_request_handler(s->impl_->ctx, "**", on_request, s->impl_.get());
  s->port_ = port;
  mg_server_port bound[1] = {};
  if (port == 0 && mg_get_server_ports(s->impl_->ctx, 1, bound) == 1) s->port_ = bound[0].port;
  if (s->port_ == 0) return fail("civetweb did not say which port it bound");
  return s;
}

http_server::~http_server() = default;

}  // namespace dtactor
