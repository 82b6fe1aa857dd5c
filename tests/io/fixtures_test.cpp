// The loaders against what the real producers' readers see: for every committed fixture (or those
// in $LOSSGUARD_FIXTURE_DIR), fixtures/make_torch_fixtures.py wrote expected/<file>.json from
// torch.load, safetensors or Python's json; the batch lossguard builds must hold exactly those
// values.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/errors.h"
#include "io/dump.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace lossguard::io {
namespace {

namespace fs = std::filesystem;

void expect_batch_equals(const Batch& b, const nlohmann::json& expected, const std::string& what) {
  const auto& samples = expected["samples"];
  ASSERT_EQ(b.num_samples(), static_cast<int64_t>(samples.size())) << what;
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    const auto& s = samples[i];
    const int64_t t0 = b.token_offsets[i], r0 = b.response_offsets[i], r = b.response_lengths[i];
    std::vector<int64_t> tokens(b.tokens.begin() + t0, b.tokens.begin() + b.token_offsets[i + 1]);
    ASSERT_EQ(tokens, s["tokens"].get<std::vector<int64_t>>()) << what << " sample " << i;
    ASSERT_EQ(r, s["response_length"].get<int64_t>()) << what << " sample " << i;
    std::vector<int64_t> mask(b.loss_mask.begin() + r0, b.loss_mask.begin() + r0 + r);
    ASSERT_EQ(mask, s["loss_mask"].get<std::vector<int64_t>>()) << what << " sample " << i;
    if (s.contains("logits")) {
      ASSERT_TRUE(b.logits.has_value()) << what;
      const int64_t v = b.vocab_size();
      for (int64_t j = 0; j < r; ++j) {
        for (int64_t c = 0; c < v; ++c) {
          ASSERT_EQ(b.logits->get_f64((r0 + j) * v + c), s["logits"][j][c].get<double>())
              << what << " sample " << i << " logits[" << j << "][" << c << "]";
        }
      }
    } else {
      EXPECT_FALSE(b.logits.has_value() && r > 0) << what;
    }
    for (const auto& name : per_token_field_names()) {
      if (!s.contains(name)) {
        EXPECT_EQ(b.per_token.count(name), 0u) << what << " has unexpected " << name;
        continue;
      }
      ASSERT_EQ(b.per_token.count(name), 1u) << what << " lacks " << name;
      for (int64_t j = 0; j < r; ++j) {
        ASSERT_EQ(b.per_token.at(name).get_f64(r0 + j), s[name][j].get<double>())
            << what << " sample " << i << " " << name;
      }
    }
  }
}

TEST(Fixtures, LoaderReadsEveryFixtureAsItsProducersReaderDoes) {
  const fs::path dir = testing::fixture_dir();
  std::size_t checked = 0;
  std::set<std::string> formats;
  for (const auto& e : fs::directory_iterator(dir / "expected")) {
    const std::string name = e.path().filename().string();
    const fs::path dump = dir / name.substr(0, name.size() - 5);  // drop ".json"
    SCOPED_TRACE(dump.string());
    ASSERT_TRUE(fs::exists(dump));
    const nlohmann::json expected = nlohmann::json::parse(testing::read_file(e.path()));
    Dump d = read_dump(dump.string());
    formats.insert(dump_format_name(d.format));
    Batch b = build_batch({d}, {});
    expect_batch_equals(b, expected, dump.string());
    ++checked;
  }
  EXPECT_GE(checked, 20u) << "expected files in " << dir;
  EXPECT_EQ(formats.size(), 3u) << "every format must be covered";
}

TEST(Fixtures, ProducerSpecificShapesAreCovered) {
  // The fixtures that exercise the unpickler's harder paths must exist and load.
  const fs::path dir = testing::fixture_dir();
  for (const char* f :
       {"torch_views_params.pt", "torch_packed_bf16_proto5.pt", "torch_packed_fp16_proto2.pt",
        "torch_relax_rollout.pt", "torch_relax_train.pt", "torch_packed.safetensors"}) {
    SCOPED_TRACE(f);
    ASSERT_TRUE(fs::exists(dir / "expected" / (std::string(f) + ".json")));
  }
  Dump d = read_dump((dir / "torch_views_params.pt").string());
  Batch b = build_batch({d}, {});
  EXPECT_EQ(b.logits->dtype, DType::kFloat64);
  EXPECT_EQ(b.per_token.at("old_log_probs").dtype, DType::kFloat32);
  EXPECT_EQ(b.metadata["rollout_id"], "0x400000000000000000");  // 2**70 kept exactly, as hex
  Dump st = read_dump((dir / "torch_packed.safetensors").string());
  Batch sb = build_batch({st}, {});
  EXPECT_EQ(sb.metadata["trainer"], "relax");
  EXPECT_EQ(sb.logits->dtype, DType::kBFloat16);
}

TEST(Fixtures, OpaqueObjectsOnlyFailWhenNeeded) {
  const fs::path dir = testing::fixture_dir();
  Dump ok = read_dump((dir / "opaque_unneeded_numpy.pt").string());
  EXPECT_EQ(build_batch({ok}, {}).num_samples(), 1);
  Dump bad = read_dump((dir / "opaque_tokens_numpy.pt").string());
  try {
    build_batch({bad}, {});
    FAIL() << "expected an InputError";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("sample 0: field 'tokens'"), std::string::npos) << m;
    EXPECT_NE(m.find("numpy"), std::string::npos) << m;
  }
}

TEST(Fixtures, SeveralDumpsFormOneBatchInOrder) {
  const fs::path dir = testing::fixture_dir();
  Dump a = read_dump((dir / "torch_packed_fp16_proto2.pt").string());
  Dump b = read_dump((dir / "torch_packed_fp32.pt").string());
  Batch ab = build_batch({a, b}, {});
  Batch aa = build_batch({a}, {});
  Batch bb = build_batch({b}, {});
  EXPECT_EQ(ab.num_samples(), aa.num_samples() + bb.num_samples());
  EXPECT_EQ(ab.origins.back().file_index, 1);
  EXPECT_EQ(ab.describe_sample(aa.num_samples()),
            (dir / "torch_packed_fp32.pt").string() + ": sample 0 (global sample 5)");
  EXPECT_EQ(ab.logits->dtype,
            DType::kFloat16);  // the first dump's dtype; later dumps convert into it
}

TEST(FieldMap, MapsOtherKeyNames) {
  auto dir = testing::temp_dir("fieldmap");
  testing::write_file(dir / "m.json",
                      R"({"samples": [{"ids": [1,2,3], "response_length": 2, "mask": [1,0]}]})");
  Dump d = read_dump((dir / "m.json").string());
  EXPECT_THROW(build_batch({d}, {}), InputError);
  FieldMap map;
  map.add("tokens=ids");
  map.add("loss_mask=mask");
  Batch b = build_batch({d}, map);
  EXPECT_EQ(b.mask_sum(0), 1);
  EXPECT_THROW(map.add("nonsense=x"), InputError);
  EXPECT_THROW(map.add("tokens"), InputError);
}

TEST(Writers, EveryFormatRoundTrips) {
  auto dir = testing::temp_dir("roundtrip");
  Batch src;
  {
    Dump d = read_dump((fs::path(testing::fixture_dir()) / "torch_packed_bf16_proto5.pt").string());
    src = build_batch({d}, {});
  }
  for (const char* ext : {".safetensors", ".pt", ".json"}) {
    const std::string p = (dir / (std::string("b") + ext)).string();
    write_batch(src, p);
    Batch back = build_batch({read_dump(p)}, {});
    EXPECT_EQ(back.tokens, src.tokens) << ext;
    EXPECT_EQ(back.loss_mask, src.loss_mask) << ext;
    ASSERT_TRUE(back.logits.has_value()) << ext;
    for (int64_t k = 0; k < src.logits->numel(); ++k)
      ASSERT_EQ(back.logits->get_f64(k), src.logits->get_f64(k)) << ext;
  }
}

}  // namespace
}  // namespace lossguard::io
