// Every malformed or hostile dump of the catalog is an InputError that names the file and the
// problem; hostile pickles run nothing.
#include <gtest/gtest.h>

#include "core/errors.h"
#include "io/dump.h"
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
