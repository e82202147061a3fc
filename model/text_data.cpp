#include "model/text_data.hpp"

#include <algorithm>
#include <cctype>
#include <map>
#include <unordered_map>
#include <utility>

#include "base/hash.hpp"

namespace dtactor {

namespace {

constexpr uint64_t split_seed = 0x7370'6c69'7474'6578ULL;  // fixed: the split is part of the data's definition

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> split_lines(std::string_view s) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (start < s.size()) {
    size_t nl = s.find('\n', start);
    if (nl == std::string_view::npos) nl = s.size();
    out.push_back(s.substr(start, nl - start));
    start = nl + 1;
  }
  return out;
}

// "Achilles' /ɐkˈɪliːz/" -> "Achilles'": drops every " /.../" span.
std::string strip_pronunciations(std::string_view line) {
  std::string out;
  size_t i = 0;
  while (i < line.size()) {
    if (line[i] == '/') {
      size_t close = line.find('/', i + 1);
      if (close == std::string_view::npos) break;
      i = close + 1;
      continue;
    }
    out += line[i++];
  }
  std::string collapsed;
  for (char c : out) {
    if (c == ' ' && (collapsed.empty() || collapsed.back() == ' ')) continue;
    collapsed += c;
  }
  return std::string(trim(collapsed));
}

// "1. principalmente, soprattutto" -> "principalmente".
std::string first_translation(std::string_view line) {
  line = trim(line);
  size_t i = 0;
  while (i < line.size() && std::isdigit(static_cast<unsigned char>(line[i]))) ++i;
  if (i > 0 && i < line.size() && line[i] == '.') line = trim(line.substr(i + 1));
  size_t comma = line.find_first_of(",;");
  if (comma != std::string_view::npos) line = line.substr(0, comma);
  return std::string(trim(line));
}

}  // namespace

bool is_held_out(std::string_view key, double val_fraction) {
  if (val_fraction <= 0) return false;
  if (val_fraction >= 1) return true;
  const uint64_t h = hash64(key.data(), key.size(), split_seed);
  const double u = static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);  // [0,1), 53 bits
  return u < val_fraction;
}

std::vector<uint32_t> utf8_decode(std::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int extra = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xE ? 2 : (c >> 3) == 0x1E ? 3 : -1;
    if (extra < 0 || s.size() - i <= static_cast<size_t>(extra)) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    uint32_t cp = extra == 0 ? c : extra == 1 ? (c & 0x1F) : extra == 2 ? (c & 0x0F) : (c & 0x07);
    bool ok = true;
    for (int k = 1; k <= extra; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) {
        ok = false;
        break;
      }
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (!ok) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += 1 + extra;
  }
  return out;
}

int64_t utf8_length(std::string_view s) { return static_cast<int64_t>(utf8_decode(s).size()); }

std::string utf8_encode(const std::vector<uint32_t>& cps) {
  std::string out;
  for (uint32_t cp : cps) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  return out;
}

std::vector<word_pair> freedict_pairs(const dictd_database& db, int64_t max_chars) {
  // english -> (offset, italian): the entry earliest in the text wins, so the
  // result does not depend on the order of the index.
  std::map<std::string, std::pair<uint64_t, std::string>> best;
  for (const auto& e : db.entries) {
    if (e.headword.empty()) continue;
    auto lines = split_lines(db.definition(e));
    if (lines.size() < 2 || lines[0].find('/') == std::string_view::npos) continue;
    std::string english = strip_pronunciations(lines[0]);
    std::string italian = first_translation(lines[1]);
    if (english.empty() || italian.empty() || italian.find("...") != std::string::npos) continue;
    if (english.find('\t') != std::string::npos || italian.find('\t') != std::string::npos) continue;
    if (max_chars > 0 && (utf8_length(english) > max_chars || utf8_length(italian) > max_chars)) continue;
    auto it = best.find(english);
    if (it == best.end() || e.offset < it->second.first) best[english] = {e.offset, std::move(italian)};
  }
  std::vector<word_pair> out;
  out.reserve(best.size());
  for (auto& [en, v] : best) out.push_back(word_pair{en, v.second});
  return out;
}

word_pairs split_pairs(const std::vector<word_pair>& pairs, double val_fraction) {
  word_pairs out;
  for (const auto& p : pairs) (is_held_out(p.english, val_fraction) ? out.held_out : out.train).push_back(p);
  auto by_english = [](const word_pair& a, const word_pair& b) { return a.english < b.english; };
  std::sort(out.train.begin(), out.train.end(), by_english);
  std::sort(out.held_out.begin(), out.held_out.end(), by_english);
  return out;
}

result<word_pairs> load_eng_ita_pairs(const std::string& prefix, int64_t max_chars, double val_fraction) {
  auto db = read_dictd(prefix, "dict-freedict-eng-ita");
  if (!db) return db.err();
  auto pairs = freedict_pairs(db.value(), max_chars);
  if (pairs.empty()) return make_error("no English->Italian pairs found in '" + prefix + ".index' (check data.freedict_eng_ita and model.context)");
  return split_pairs(pairs, val_fraction);
}

std::string clean_gcide_definition(std::string_view raw) {
  std::string out;
  bool last_blank = true;  // also drops leading blank lines
  for (auto line : split_lines(raw)) {
    line = trim(line);
    if (line.size() >= 2 && line.front() == '[' && line.back() == ']' && line.find(']') == line.size() - 1) continue;
    std::string clean;
    for (size_t i = 0; i < line.size(); ++i) {
      const char c = line[i];
      if (c == '\\') {
        size_t close = line.find('\\', i + 1);
        if (close != std::string_view::npos) {
          if (!clean.empty() && clean.back() == ' ') clean.pop_back();
          i = close;
          // A spelled-out pronunciation may follow: "([a^]b`[a^]n*n[=a]"sh[u^]n)".
          size_t j = i + 1;
          while (j < line.size() && line[j] == ' ') ++j;
          if (j < line.size() && line[j] == '(') {
            const size_t end = line.find(')', j);
            if (end != std::string_view::npos && line.substr(j, end - j).find('[') != std::string_view::npos) i = end;
          }
          continue;
        }
      }
      // Source tags, also those that lost their line break ("[1913 Webster] Abannation").
      if (c == '[') {
        const size_t close = line.find(']', i);
        if (close != std::string_view::npos) {
          const auto tag = line.substr(i, close - i);
          if (tag.find("Webster") != std::string_view::npos || tag.find("WordNet") != std::string_view::npos ||
              tag.find("PJC") != std::string_view::npos) {
            i = close;
            while (i + 1 < line.size() && line[i + 1] == ' ') ++i;
            continue;
          }
        }
      }
      if (c == '{' || c == '}') continue;
      clean += c;
    }
    while (!clean.empty() && clean.back() == ' ') clean.pop_back();
    if (clean.empty()) {
      if (!last_blank) out += '\n';
      last_blank = true;
      continue;
    }
    out += clean;
    out += '\n';
    last_blank = false;
  }
  while (out.size() >= 2 && out[out.size() - 1] == '\n' && out[out.size() - 2] == '\n') out.pop_back();
  return out;
}

text_corpus gcide_corpus(const dictd_database& db, double val_fraction, int64_t max_bytes) {
  // (offset, length) -> smallest headword pointing there; std::map keeps text order.
  std::map<std::pair<uint64_t, uint64_t>, std::string_view> blocks;
  for (const auto& e : db.entries) {
    if (e.headword.rfind("00-", 0) == 0) continue;  // gcide's own meta entries ("00-gcide-long")
    auto [it, inserted] = blocks.emplace(std::make_pair(e.offset, e.length), e.headword);
    if (!inserted && std::string_view(e.headword) < it->second) it->second = e.headword;
  }
  text_corpus c;
  const auto cap = static_cast<uint64_t>(max_bytes);
  for (const auto& [range, key] : blocks) {
    std::string text = clean_gcide_definition(std::string_view(db.text).substr(range.first, range.second));
    if (text.empty()) continue;
    if (max_bytes > 0) {
      const uint64_t used = c.train.size() + c.held_out.size();
      if (used >= cap) break;
      if (used + text.size() > cap) text.resize(cap - used);
    }
    if (is_held_out(key, val_fraction)) {
      c.held_out += text;
      ++c.held_out_entries;
    } else {
      c.train += text;
      ++c.train_entries;
    }
  }
  return c;
}

result<text_corpus> load_gcide_corpus(const std::string& prefix, double val_fraction, int64_t max_bytes) {
  auto db = read_dictd(prefix, "dict-gcide");
  if (!db) return db.err();
  return gcide_corpus(db.value(), val_fraction, max_bytes);
}

}  // namespace dtactor
