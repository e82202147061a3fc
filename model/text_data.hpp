#pragma once
// The text data sets, read in place from Debian's dictd packages:
// English->Italian word pairs (FreeDict) for the encoder-decoder and GCIDE
// (Webster 1913) definitions as a byte corpus for the GPT. Train/held-out
// splits hash a key of each item (hash64), so they never depend on file
// order or on how many items there are. No LibTorch here.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/dictd.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

// Whether the item with this key belongs to the held-out share val_fraction
// (a pure function of key and fraction; 0 holds nothing out, 1 everything).
bool is_held_out(std::string_view key, double val_fraction);

// Unicode code points in a UTF-8 string (bytes that are not a valid lead
// byte count as one each).
int64_t utf8_length(std::string_view s);
// Splits UTF-8 into code points (invalid bytes become U+FFFD).
std::vector<uint32_t> utf8_decode(std::string_view s);
std::string utf8_encode(const std::vector<uint32_t>& code_points);

struct word_pair {
  std::string english;
  std::string italian;
  bool operator==(const word_pair& o) const { return english == o.english && italian == o.italian; }
};

struct word_pairs {
  std::vector<word_pair> train;     // sorted by english
  std::vector<word_pair> held_out;  // sorted by english
};

// One pair per English word: the English form of the entry's first line
// (pronunciations "/.../" removed, case kept) and the first Italian
// translation (numbering "1." and further synonyms after ',' removed).
// Entries without a usable translation ("non ... che", empty) are skipped;
// when a word has several entries the one earliest in the text wins. Both
// sides must have 1..max_chars code points (max_chars <= 0: no limit).
// Sorted by english.
std::vector<word_pair> freedict_pairs(const dictd_database& db, int64_t max_chars);

word_pairs split_pairs(const std::vector<word_pair>& pairs, double val_fraction);

// Reads FreeDict eng-ita at `prefix` (data.freedict_eng_ita) and splits it by
// hashing the English word.
result<word_pairs> load_eng_ita_pairs(const std::string& prefix, int64_t max_chars, double val_fraction);

struct text_corpus {
  std::string train;
  std::string held_out;
  int64_t train_entries = 0;
  int64_t held_out_entries = 0;
};

// A GCIDE definition as plain text: indentation removed, pronunciations
// ("\Ab*do"men\") and cross-reference braces dropped, source tags on their
// own line ("[1913 Webster]") dropped, no runs of blank lines. Ends in '\n'
// unless empty.
std::string clean_gcide_definition(std::string_view raw);

// The definitions of GCIDE in text order, each once (many headwords share a
// definition), concatenated. An entry is held out by hashing the smallest
// headword that points to it. max_bytes > 0 caps train + held-out in total,
// taking entries in text order.
text_corpus gcide_corpus(const dictd_database& db, double val_fraction, int64_t max_bytes);

result<text_corpus> load_gcide_corpus(const std::string& prefix, double val_fraction, int64_t max_bytes);

}  // namespace dtactor
