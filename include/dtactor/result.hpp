#pragma once
// Part of dtactor's public C++ API (dtactor/dtactor.hpp).
// A small error-as-value type used at module boundaries: every
// failure a user can cause carries one clear, complete line of text.
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace dtactor {

// What kind of failure, where a caller decides by it (as LevelDB's Status
// codes): most errors are only reported, and stay `unspecified`.
enum class errc {
  unspecified = 0,
  out_of_memory,        // an allocation failed (host or device memory)
  batch_exceeds_data,   // train.global_batch_size is larger than the training set
  corrupt_checkpoint,   // a checkpoint's manifest or parts do not check out (checksum, size, missing, undecodable)
  busy,                 // held by another live process (a lock): the message names the holder
};

struct error {
  std::string message;
  errc code = errc::unspecified;
};

inline error make_error(std::string message, errc code = errc::unspecified) { return error{std::move(message), code}; }

template <class T>
class result {
 public:
  result(T value) : v_(std::move(value)) {}
  result(error e) : v_(std::move(e)) {}

  bool ok() const noexcept { return v_.index() == 0; }
  explicit operator bool() const noexcept { return ok(); }
  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const error& err() const { return std::get<1>(v_); }
  const std::string& message() const { return err().message; }
  errc code() const { return ok() ? errc::unspecified : err().code; }

 private:
  std::variant<T, error> v_;
};

// result<void> equivalent.
class status {
 public:
  status() = default;
  status(error e) : e_(std::move(e)) {}
  static status success() { return {}; }
  bool ok() const noexcept { return !e_.has_value(); }
  explicit operator bool() const noexcept { return ok(); }
  const error& err() const { return *e_; }
  const std::string& message() const { return e_->message; }
  errc code() const { return e_ ? e_->code : errc::unspecified; }

 private:
  std::optional<error> e_;
};

}  // namespace dtactor
