// dictd reading and the text data sets (FreeDict eng-ita pairs, GCIDE corpus).
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "model/dictd.hpp"
#include "model/text_data.hpp"

namespace dtactor {
namespace {

namespace fs = std::filesystem;

const std::string freedict = "/usr/share/dictd/freedict-eng-ita";
const std::string gcide = "/usr/share/dictd/gcide";

// A fresh folder per test, removed afterwards.
class scratch_dir {
 public:
  scratch_dir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() / ("dtactor_text_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~scratch_dir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

void write_gzip(const std::string& path, const std::string& text) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, text.data(), static_cast<unsigned>(text.size())), static_cast<int>(text.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(TextDictd, Base64DigitsAreBigEndian) {
  EXPECT_EQ(decode_dictd_base64("A"), 0u);
  EXPECT_EQ(decode_dictd_base64("B"), 1u);
  EXPECT_EQ(decode_dictd_base64("z"), 51u);
  EXPECT_EQ(decode_dictd_base64("9"), 61u);
  EXPECT_EQ(decode_dictd_base64("+"), 62u);
  EXPECT_EQ(decode_dictd_base64("/"), 63u);
  EXPECT_EQ(decode_dictd_base64("BA"), 64u);
  EXPECT_EQ(decode_dictd_base64("C6f"), 2u * 4096 + 58 * 64 + 31);
  EXPECT_FALSE(decode_dictd_base64("").has_value());
  EXPECT_FALSE(decode_dictd_base64("A-B").has_value());
  EXPECT_FALSE(decode_dictd_base64("A=").has_value());
  EXPECT_FALSE(decode_dictd_base64("//////////////").has_value());  // 84 bits: overflow
}

TEST(TextDictd, MetaHeadwords) {
  EXPECT_TRUE(is_dictd_meta_headword("00-database-info"));
  EXPECT_TRUE(is_dictd_meta_headword("00databaseshort"));
  EXPECT_FALSE(is_dictd_meta_headword("0"));
  EXPECT_FALSE(is_dictd_meta_headword("abandon"));
}

TEST(TextDictd, ReadsSmallDatabase) {
  scratch_dir dir;
  const std::string text = "00-database-short\nTest\nhouse /h/\ncasa\ndog /d/\ncane\n";
  write_gzip(dir.file("t.dict.dz"), text);
  // offsets: meta 0+23, house 23+15 ("X" = 23, "P" = 15), dog 38+13 ("m", "N")
  write_file(dir.file("t.index"), "00-database-short\tA\tX\nhouse\tX\tP\ndog\tm\tN\n");
  auto db = read_dictd(dir.file("t"), "dict-test");
  ASSERT_TRUE(db.ok()) << db.message();
  ASSERT_EQ(db->entries.size(), 2u);
  EXPECT_EQ(db->entries[0].headword, "house");
  EXPECT_EQ(db->definition(db->entries[0]), "house /h/\ncasa\n");
  EXPECT_EQ(db->definition(db->entries[1]), "dog /d/\ncane\n");
}

TEST(TextDictd, MissingFileIsAnErrorNamingThePackage) {
  auto db = read_dictd("/nonexistent/dtactor/freedict-eng-ita", "dict-freedict-eng-ita");
  ASSERT_FALSE(db.ok());
  EXPECT_NE(db.message().find("/nonexistent/dtactor/freedict-eng-ita.index"), std::string::npos) << db.message();
  EXPECT_NE(db.message().find("install Debian package dict-freedict-eng-ita"), std::string::npos) << db.message();
  EXPECT_EQ(db.message().find('\n'), std::string::npos);

  scratch_dir dir;  // index present, .dict.dz missing
  write_file(dir.file("t.index"), "a\tA\tB\n");
  auto db2 = read_dictd(dir.file("t"), "dict-test");
  ASSERT_FALSE(db2.ok());
  EXPECT_NE(db2.message().find("t.dict.dz"), std::string::npos) << db2.message();
  EXPECT_NE(db2.message().find("dict-test"), std::string::npos) << db2.message();
}

TEST(TextDictd, CorruptGzipIsAnError) {
  scratch_dir dir;
  write_file(dir.file("t.index"), "a\tA\tB\n");
  write_file(dir.file("t.dict.dz"), "this is not gzip at all, just text");
  auto db = read_dictd(dir.file("t"), "dict-test");
  ASSERT_FALSE(db.ok());
  EXPECT_NE(db.message().find("t.dict.dz"), std::string::npos) << db.message();
  EXPECT_NE(db.message().find("not a valid gzip"), std::string::npos) << db.message();

  // A real dictzip file cut in half: the stream ends early.
  const std::string real = read_file(freedict + ".dict.dz");
  ASSERT_GT(real.size(), 1000u) << "install Debian package dict-freedict-eng-ita";
  write_file(dir.file("t.dict.dz"), real.substr(0, real.size() / 2));
  auto cut = read_dictd(dir.file("t"), "dict-test");
  ASSERT_FALSE(cut.ok());
  EXPECT_NE(cut.message().find("t.dict.dz"), std::string::npos) << cut.message();

  // Flipped bytes in the middle of the deflate stream.
  std::string flipped = real;
  for (size_t i = real.size() / 2; i < real.size() / 2 + 64; ++i) flipped[i] = static_cast<char>(~flipped[i]);
  write_file(dir.file("t.dict.dz"), flipped);
  EXPECT_FALSE(read_dictd(dir.file("t"), "dict-test").ok());
}

TEST(TextDictd, EntryPastTheEndIsAnError) {
  scratch_dir dir;
  write_gzip(dir.file("t.dict.dz"), "short text\n");
  write_file(dir.file("t.index"), "word\tA\tBA\n");  // 64 bytes from 0, text has 11
  auto db = read_dictd(dir.file("t"), "dict-test");
  ASSERT_FALSE(db.ok());
  EXPECT_NE(db.message().find("past the end"), std::string::npos) << db.message();
  EXPECT_NE(db.message().find("t.index:1"), std::string::npos) << db.message();

  write_file(dir.file("t.index"), "word only\n");
  EXPECT_FALSE(read_dictd(dir.file("t"), "dict-test").ok());
}

TEST(TextDictd, ReadsFreeDict) {
  auto db = read_dictd(freedict, "dict-freedict-eng-ita");
  ASSERT_TRUE(db.ok()) << db.message();
  EXPECT_GT(db->entries.size(), 4000u);
  EXPECT_LT(db->entries.size(), 5000u);
  bool found = false;
  for (const auto& e : db->entries) {
    EXPECT_FALSE(is_dictd_meta_headword(e.headword));
    if (e.headword == "abandon") {
      found = true;
      EXPECT_NE(db->definition(e).find("abbandonare"), std::string::npos);
    }
  }
  EXPECT_TRUE(found);
}

TEST(TextData, FreeDictPairs) {
  auto pairs = load_eng_ita_pairs(freedict, 128, 0.1);
  ASSERT_TRUE(pairs.ok()) << pairs.message();
  const size_t total = pairs->train.size() + pairs->held_out.size();
  EXPECT_GT(total, 3500u);
  EXPECT_LT(total, 4600u);
  std::map<std::string, std::string> all;
  for (const auto* part : {&pairs->train, &pairs->held_out})
    for (const auto& p : *part) {
      EXPECT_FALSE(p.english.empty());
      EXPECT_FALSE(p.italian.empty());
      EXPECT_EQ(p.english.find('/'), std::string::npos) << p.english;  // pronunciation stripped
      EXPECT_EQ(p.italian.find('\n'), std::string::npos) << p.italian;
      EXPECT_EQ(p.italian.find("..."), std::string::npos) << p.italian;
      EXPECT_EQ(p.italian.find(','), std::string::npos) << p.italian;
      EXPECT_TRUE(all.emplace(p.english, p.italian).second) << "duplicate " << p.english;
    }
  EXPECT_EQ(all["abandon"], "abbandonare");
  EXPECT_EQ(all["chiefly"], "principalmente");  // "1. principalmente, soprattutto"
  EXPECT_EQ(all["house"], "casa");

  auto short_only = load_eng_ita_pairs(freedict, 8, 0.1);
  ASSERT_TRUE(short_only.ok());
  for (const auto& p : short_only->train) {
    EXPECT_LE(utf8_length(p.english), 8);
    EXPECT_LE(utf8_length(p.italian), 8);
  }
  EXPECT_LT(short_only->train.size(), pairs->train.size());
}

TEST(TextData, SplitIsDeterministicDisjointAndOrderFree) {
  auto db = read_dictd(freedict, "dict-freedict-eng-ita");
  ASSERT_TRUE(db.ok()) << db.message();
  auto pairs = freedict_pairs(db.value(), 0);
  auto a = split_pairs(pairs, 0.2);
  auto reversed = pairs;
  std::reverse(reversed.begin(), reversed.end());
  auto b = split_pairs(reversed, 0.2);
  EXPECT_EQ(a.train, b.train);
  EXPECT_EQ(a.held_out, b.held_out);

  std::set<std::string> train_words;
  for (const auto& p : a.train) train_words.insert(p.english);
  for (const auto& p : a.held_out) EXPECT_EQ(train_words.count(p.english), 0u) << p.english;
  EXPECT_EQ(a.train.size() + a.held_out.size(), pairs.size());
  const double share = static_cast<double>(a.held_out.size()) / static_cast<double>(pairs.size());
  EXPECT_NEAR(share, 0.2, 0.03);

  // The index order does not matter either.
  dictd_database shuffled = db.value();
  std::reverse(shuffled.entries.begin(), shuffled.entries.end());
  EXPECT_EQ(freedict_pairs(shuffled, 0), pairs);

  EXPECT_TRUE(split_pairs(pairs, 0.0).held_out.empty());
  EXPECT_TRUE(split_pairs(pairs, 1.0).train.empty());
  // Growing the fraction only moves items into held-out.
  auto bigger = split_pairs(pairs, 0.3);
  std::set<std::string> bigger_held;
  for (const auto& p : bigger.held_out) bigger_held.insert(p.english);
  for (const auto& p : a.held_out) EXPECT_EQ(bigger_held.count(p.english), 1u);
}

TEST(TextData, Utf8RoundTrip) {
  const std::string s = "abilità città";
  auto cps = utf8_decode(s);
  EXPECT_EQ(cps.size(), 13u);
  EXPECT_EQ(utf8_length(s), 13);
  EXPECT_EQ(utf8_encode(cps), s);
  EXPECT_EQ(utf8_decode(std::string("a\xff") + "b"), (std::vector<uint32_t>{'a', 0xFFFD, 'b'}));
  EXPECT_EQ(utf8_decode("\xc3"), std::vector<uint32_t>{0xFFFD});  // cut inside a character
}

TEST(TextData, CleansGcideMarkup) {
  const std::string raw =
      "Pelagic \\Pe*lag\"ic\\ (p[-e]*l[a^]j\"[i^]k), a. [L. pelagicus.]\n"
      "   Of or pertaining to the ocean. Compare {benthic}.\n"
      "   [1913 Webster]\n"
      "\n\n"
      "   {Cockling sea}, waves.\n"
      "   [1913 Webster] Abannation\n";
  EXPECT_EQ(clean_gcide_definition(raw),
            "Pelagic, a. [L. pelagicus.]\nOf or pertaining to the ocean. Compare benthic.\n\nCockling sea, waves.\nAbannation\n");
  EXPECT_EQ(clean_gcide_definition("\n\n  \n"), "");
}

class TextGcide : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto r = read_dictd(gcide, "dict-gcide");
    if (r.ok()) db_ = new dictd_database(std::move(r.value()));
    else message_ = r.message();
  }
  static void TearDownTestSuite() {
    delete db_;
    db_ = nullptr;
  }
  static dictd_database* db_;
  static std::string message_;
};
dictd_database* TextGcide::db_ = nullptr;
std::string TextGcide::message_;

TEST_F(TextGcide, ReadsGcide) {
  ASSERT_NE(db_, nullptr) << message_;
  EXPECT_GT(db_->entries.size(), 150000u);
  EXPECT_GT(db_->text.size(), 30u << 20);
  auto it = std::find_if(db_->entries.begin(), db_->entries.end(), [](const dictd_entry& e) { return e.headword == "Pelagic"; });
  ASSERT_NE(it, db_->entries.end());
  EXPECT_NE(db_->definition(*it).find("ocean"), std::string::npos);
}

TEST_F(TextGcide, CorpusIsCappedSplitAndClean) {
  ASSERT_NE(db_, nullptr) << message_;
  const int64_t cap = 2 << 20;
  auto c = gcide_corpus(*db_, 0.1, cap);
  EXPECT_LE(static_cast<int64_t>(c.train.size() + c.held_out.size()), cap);
  EXPECT_GT(static_cast<int64_t>(c.train.size() + c.held_out.size()), cap - 4096);
  const double share = static_cast<double>(c.held_out_entries) / static_cast<double>(c.train_entries + c.held_out_entries);
  EXPECT_NEAR(share, 0.1, 0.03);
  EXPECT_EQ(c.train.find("[1913 Webster]"), std::string::npos);
  EXPECT_EQ(c.train.find("00-database"), std::string::npos);
  EXPECT_EQ(c.train.find('{'), std::string::npos);

  auto again = gcide_corpus(*db_, 0.1, cap);
  EXPECT_EQ(again.train, c.train);
  EXPECT_EQ(again.held_out, c.held_out);
  // The held-out text shares no definition with the training text.
  // The held-out text shares no definition with the training text: its
  // first long line is nowhere in the training text.
  size_t start = 0, end = 0;
  while ((end = c.held_out.find('\n', start)) != std::string::npos && end - start < 50) start = end + 1;
  ASSERT_NE(end, std::string::npos);
  const auto long_line = c.held_out.substr(start, end - start + 1);
  EXPECT_EQ(c.train.find(long_line), std::string::npos) << long_line;
}

}  // namespace
}  // namespace dtactor
