#include "base/printable.hpp"

#include <cstdint>
#include <cstdio>

namespace dtactor {

namespace {

// The length of the valid UTF-8 sequence at `s[i]` and its code point, or 0
// when the bytes there are not one (overlong forms and surrogates included).
std::size_t utf8_sequence(std::string_view s, std::size_t i, uint32_t& cp) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  std::size_t n = 0;
  uint32_t min = 0;
  if (c >= 0xc2 && c <= 0xdf) n = 2, cp = c & 0x1f, min = 0x80;
  else if (c >= 0xe0 && c <= 0xef) n = 3, cp = c & 0x0f, min = 0x800;
  else if (c >= 0xf0 && c <= 0xf4) n = 4, cp = c & 0x07, min = 0x10000;
  else return 0;
  if (i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (b(k) & 0x3f);
  }
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return n;
}

// Code points that are valid but steer a terminal or a page: C1 controls,
// bidirectional marks and overrides (text that reads differently from what
// it is), line and paragraph separators.
bool is_steering(uint32_t cp) {
  return (cp >= 0x80 && cp <= 0x9f) || cp == 0x61c || cp == 0x200e || cp == 0x200f || (cp >= 0x2028 && cp <= 0x202e) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

std::string escaped_byte(unsigned char c) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "\\x%02x", c);
  return buf;
}

}  // namespace

std::string printable(std::string_view text, std::size_t max_chars) {
  std::string out;
  std::size_t chars = 0;  // output characters so far (a UTF-8 sequence counts as one)
  for (std::size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    std::string piece;
    std::size_t used = 1, width = 1;
    uint32_t cp = 0;
    if (c >= 0x20 && c < 0x7f) {
      piece.assign(1, static_cast<char>(c));
    } else if (c < 0x80) {
      piece = escaped_byte(c);
      width = piece.size();
    } else if (std::size_t n = utf8_sequence(text, i, cp); n == 0) {
      piece = escaped_byte(c);
      width = piece.size();
    } else if (is_steering(cp)) {
      char buf[16];
      std::snprintf(buf, sizeof buf, "\\u{%04x}", static_cast<unsigned>(cp));
      piece = buf;
      width = piece.size();
      used = n;
    } else {
      piece.assign(text.substr(i, n));
      used = n;
    }
    if (max_chars > 0 && chars + width > max_chars) {
      out += "...(" + std::to_string(text.size()) + " bytes)";
      return out;
    }
    out += piece;
    chars += width;
    i += used;
  }
  return out;
}

}  // namespace dtactor
