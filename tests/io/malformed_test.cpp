// Every malformed or hostile dump of the catalog is an InputError that names the file and the
// problem; hostile pickles run nothing.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/errors.h"
#include "io/dump.h"
#include "io/safetensors.h"
#include "malformed_catalog.h"
#include "test_util.h"

namespace lossguard::io {
namespace {

TEST(Malformed, EveryCatalogEntryIsAnInputErrorNamingFileAndProblem) {
  const auto dir = testing::temp_dir("malformed-io");
  const auto catalog = testing::write_malformed_catalog(dir, testing::fixture_dir());
  EXPECT_GE(catalog.size(), 47u);
  for (const auto& m : catalog) {
    SCOPED_TRACE(m.name);
    std::string msg;
    try {
      build_batch({read_dump(m.path)}, {});
    } catch (const InputError& e) {
      msg = e.what();
    }
    ASSERT_FALSE(msg.empty()) << "loaded without error";
    EXPECT_NE(msg.find(m.path), std::string::npos) << msg;
    EXPECT_NE(msg.find(m.expected), std::string::npos) << msg;
  }
}

TEST(Malformed, HostilePicklesHaveNoSideEffect) {
  const char* marks[] = {"/tmp/lossguard-pwned-os-system", "/tmp/lossguard-pwned-eval",
                         "/tmp/lossguard-pwned-subprocess"};
  for (const char* m : marks) std::filesystem::remove(m);
  for (const char* f :
       {"hostile_os_system.pt", "hostile_eval.pt", "hostile_subprocess.pt", "hostile_getattr.pt"}) {
    EXPECT_THROW(read_dump((std::filesystem::path(testing::fixture_dir()) / f).string()),
                 InputError)
        << f;
  }
  for (const char* m : marks) EXPECT_FALSE(std::filesystem::exists(m)) << m;
}

}  // namespace
}  // namespace lossguard::io

namespace lossguard::io {
namespace {

// A safetensors header length is arbitrary; its low byte is the file's first byte. Every length
// from 1 to 600 bytes of metadata — 0x80 (a pickle's PROTO opcode) among the low bytes — must be
// read as safetensors, not as a legacy torch.save file.
TEST(FormatDetection, SafetensorsWhateverItsHeaderLengthIsNotAPickle) {
  const auto dir = testing::temp_dir("detect");
  int first_byte_0x80 = 0;
  for (int pad = 0; pad < 600; ++pad) {
    const std::string path = (dir / "f.safetensors").string();
    const std::string noext = (dir / "f").string();
    write_safetensors(path, {{"x", HostArray::from_i64(DType::kInt64, {1}, {7})}},
                      {{"pad", std::string(static_cast<std::size_t>(pad), 'a')}});
    std::filesystem::copy_file(path, noext, std::filesystem::copy_options::overwrite_existing);
    first_byte_0x80 += static_cast<unsigned char>(testing::read_file(path)[0]) == 0x80;
    ASSERT_EQ(detect_format(path), DumpFormat::kSafetensors) << "pad " << pad;
    ASSERT_EQ(detect_format(noext), DumpFormat::kSafetensors) << "pad " << pad << " (no extension)";
  }
  EXPECT_GE(first_byte_0x80, 2);  // the property met the shape that broke
}

// A JSON bug report states an empty response's logits as "logits": [].
TEST(FormatDetection, JsonEmptyResponseWithEmptyLogitsList) {
  const auto dir = testing::temp_dir("json-empty-logits");
  const std::string path = (dir / "b.json").string();
  testing::write_file(path, R"({"samples": [
    {"tokens": [1, 2, 3, 4], "response_length": 2, "loss_mask": [1, 1], "logits": [[0.1, 0.2, 0.3, 0.4, 0.5], [0.5, 0.4, 0.3, 0.2, 0.1]]},
    {"tokens": [1, 2, 3], "response_length": 0, "loss_mask": [], "logits": []},
    {"tokens": [4, 3, 2, 1], "response_length": 1, "loss_mask": [1], "logits": [[1.0, 2.0, 3.0, 4.0, 5.0]]}]})");
  const Batch b = build_batch({read_dump(path)}, {});
  ASSERT_EQ(b.num_samples(), 3);
  EXPECT_EQ(b.response_lengths[1], 0);
  ASSERT_TRUE(b.logits.has_value());
  EXPECT_EQ(b.logits->shape, (std::vector<int64_t>{3, 5}));
  EXPECT_DOUBLE_EQ(b.logits->get_f64(2 * 5 + 4), 5.0);  // sample 2's row follows sample 0's
}

}  // namespace
}  // namespace lossguard::io
