// The checkpoint file's pieces without a daemon: CRC-32C against known
// values and across its two implementations, and the safetensors header
// (optimizer-state tensors included) through encode and decode.
#include "server/checkpoint_format.h"

#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "server/crc32c.h"

namespace mhc::server {
namespace {

TEST(Crc32cTest, KnownValues) {
  // The check value of CRC-32C and the iSCSI test vector of 32 zeros.
  EXPECT_EQ(Crc32c(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32cPortable(0, "123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(0, zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(0, "", 0), 0u);
}

TEST(Crc32cTest, ChunksAndImplementationsAgree) {
  std::mt19937 rng(1);
  std::string data(10000, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  for (size_t start : {0, 1, 3, 7}) {
    for (size_t size : {0, 1, 7, 8, 9, 63, 4096, 9000}) {
      const char* p = data.data() + start;
      const uint32_t whole = Crc32cPortable(0, p, size);
      EXPECT_EQ(Crc32c(0, p, size), whole) << start << " " << size;
      const size_t half = size / 3;
      EXPECT_EQ(Crc32c(Crc32c(0, p, half), p + half, size - half), whole);
    }
  }
}

CheckpointHeader SampleHeader() {
  CheckpointHeader header;
  header.created_by = "mhcd test";
  v1::CheckpointLayer& layer = *header.manifest.add_layers();
  layer.set_name("l0");
  layer.set_preset("deepseek_v4");
  layer.mutable_spec()->set_n(4);
  layer.mutable_spec()->set_hidden(8);
  layer.mutable_spec()->set_eps_rms(3.0e-7f);
  layer.set_device("cpu");
  layer.set_parameters_version(12);
  layer.set_has_gradients(true);
  layer.set_gradient_tokens(99);
  layer.mutable_optimizer()->set_algorithm("adamw");
  layer.mutable_optimizer()->set_step(7);
  layer.mutable_optimizer()->add_slots("exp_avg");
  layer.add_parameters("beta");
  uint64_t offset = 0;
  for (const char* section : {"param", "grad", "optim/exp_avg"}) {
    CheckpointTensor& t =
        header.tensors[CheckpointTensorName("l0", section, "beta")];
    t.shape = {24};
    t.begin = offset;
    t.end = offset += 96;
    t.crc32c = 0xDEADBEEF;
  }
  return header;
}

TEST(CheckpointFormatTest, HeaderRoundTrip) {
  const CheckpointHeader header = SampleHeader();
  auto json = EncodeCheckpointHeader(header, 1000);
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_GE(json->size(), 1000u);
  EXPECT_EQ((8 + json->size()) % kCheckpointDataAlignment, 0u);
  EXPECT_TRUE(absl::StrContains(*json, "\"l0/optim/exp_avg/beta\""));
  auto decoded = DecodeCheckpointHeader(*json, 3 * 96);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(
      decoded->manifest, header.manifest));
  EXPECT_EQ(decoded->created_by, "mhcd test");
  ASSERT_EQ(decoded->tensors.size(), 3u);
  for (const auto& [name, want] : header.tensors) {
    const CheckpointTensor& got = decoded->tensors.at(name);
    EXPECT_EQ(got.shape, want.shape) << name;
    EXPECT_EQ(got.begin, want.begin) << name;
    EXPECT_EQ(got.end, want.end) << name;
    EXPECT_EQ(got.crc32c, want.crc32c) << name;
  }
}

TEST(CheckpointFormatTest, DecodeRefusesBadHeaders) {
  auto json = EncodeCheckpointHeader(SampleHeader());
  ASSERT_TRUE(json.ok());
  auto short_data = DecodeCheckpointHeader(*json, 3 * 96 - 1);
  EXPECT_EQ(short_data.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(short_data.status().message(), "truncated"));

  std::string f16 = *json;
  f16.replace(f16.find("\"F32\""), 5, "\"F16\"");
  EXPECT_EQ(DecodeCheckpointHeader(f16, 3 * 96).status().code(),
            absl::StatusCode::kInvalidArgument);

  std::string bad_shape = *json;
  bad_shape.replace(bad_shape.find("[24]"), 4, "[25]");
  EXPECT_EQ(DecodeCheckpointHeader(bad_shape, 3 * 96).status().code(),
            absl::StatusCode::kDataLoss);

  EXPECT_EQ(DecodeCheckpointHeader("{\"a\":1}", 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeCheckpointHeader("not json", 0).status().code(),
            absl::StatusCode::kDataLoss);

  // A tensor whose checksum entry is missing.
  CheckpointHeader header = SampleHeader();
  auto with_extra = EncodeCheckpointHeader(header);
  ASSERT_TRUE(with_extra.ok());
  std::string no_crc = *with_extra;
  const size_t at = no_crc.find("\\\"l0/grad/beta\\\":\\\"deadbeef\\\",");
  ASSERT_NE(at, std::string::npos);
  no_crc.erase(at,
               std::string("\\\"l0/grad/beta\\\":\\\"deadbeef\\\",").size());
  auto missing = DecodeCheckpointHeader(no_crc, 3 * 96);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "checksum"))
      << missing.status();
}

}  // namespace
}  // namespace mhc::server
