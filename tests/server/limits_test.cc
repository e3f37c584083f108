// Limits over a real mhcd: layers larger than --max_message_bytes come
// back through StreamParameters/StreamGradients, bit for bit, and request
// metadata up to the daemon's limit is accepted while more is refused with
// RESOURCE_EXHAUSTED.
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

constexpr int kN = 4;
// phi alone is 4 * 2048 * 24 floats (768 KiB): several pieces of a
// 256 KiB message.
constexpr int64_t kHidden = 2048;
constexpr int kSmallMessageBytes = 256 << 10;

void ExpectSameTensors(const v1::Parameters& expected,
                       const v1::Parameters& actual) {
  ASSERT_EQ(actual.tensors_size(), expected.tensors_size());
  for (const auto& [name, tensor] : expected.tensors()) {
    ASSERT_TRUE(actual.tensors().contains(name)) << name;
    const v1::TensorRef& got = actual.tensors().at(name);
    EXPECT_EQ(got.dtype(), tensor.dtype()) << name;
    EXPECT_EQ(got.shape().size(), tensor.shape().size()) << name;
    // Bytes, not values: bit-identical.
    EXPECT_TRUE(got.inline_data() == tensor.inline_data()) << name;
  }
}

TEST(LimitsTest, LayersLargerThanTheMessageLimitStream) {
  MHC_ASSERT_OK_AND_ASSIGN(auto limited,
                           Daemon::Start({absl::StrCat("--max_message_bytes=",
                                                       kSmallMessageBytes)}));
  MHC_ASSERT_OK_AND_ASSIGN(auto reference, Daemon::Start());
  MHC_ASSERT_OK_AND_ASSIGN(auto small, limited->Connect());
  MHC_ASSERT_OK_AND_ASSIGN(auto large, reference->Connect());
  // The same seed on both daemons: the same parameters.
  MHC_ASSERT_OK(small->CreateLayer(LayerRequest("big", kN, kHidden)).status());
  MHC_ASSERT_OK(large->CreateLayer(LayerRequest("big", kN, kHidden)).status());

  absl::StatusOr<v1::Parameters> whole = small->GetParameters("big");
  EXPECT_EQ(whole.status().code(), absl::StatusCode::kResourceExhausted)
      << whole.status();
  MHC_ASSERT_OK_AND_ASSIGN(v1::Parameters expected,
                           large->GetParameters("big"));
  MHC_ASSERT_OK_AND_ASSIGN(v1::Parameters streamed,
                           small->StreamParameters("big"));
  ExpectSameTensors(expected, streamed);
  MHC_ASSERT_OK_AND_ASSIGN(v1::Parameters phi,
                           small->StreamParameters("big", {"phi"}));
  EXPECT_EQ(phi.tensors_size(), 1);
  EXPECT_EQ(small->StreamParameters("big", {"nope"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(small->StreamParameters("none").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(small->StreamGradients("big").status().code(),
            absl::StatusCode::kOk);

  // Gradients after a backward: the stream answers what GetGradients does.
  const int64_t tokens = 2;
  v1::ProjectionBackwardRequest backward;
  backward.set_layer("big");
  *backward.mutable_x() = client::ToTensorRef(RandomF32({tokens, kN, kHidden}));
  *backward.mutable_dh() =
      client::ToTensorRef(RandomF32({tokens, kN * kN + 2 * kN}));
  *backward.mutable_dmean_square() = client::ToTensorRef(RandomF32({tokens}));
  MHC_ASSERT_OK(large->ProjectionBackward(backward).status());
  MHC_ASSERT_OK_AND_ASSIGN(v1::GetGradientsResponse gradients,
                           large->GetGradients("big"));
  MHC_ASSERT_OK_AND_ASSIGN(v1::GetGradientsResponse streamed_gradients,
                           large->StreamGradients("big"));
  // Projection backward accumulates phi's gradient.
  const std::string& dphi =
      gradients.gradients().tensors().at("phi").inline_data();
  EXPECT_NE(dphi.find_first_not_of('\0'), std::string::npos);
  EXPECT_EQ(streamed_gradients.gradient_tokens(), gradients.gradient_tokens());
  ExpectSameTensors(gradients.gradients(), streamed_gradients.gradients());
}

// gRPC's default header limit is 8 KiB; the daemon sets its own, larger
// one. Beyond it gRPC answers RESOURCE_EXHAUSTED (and drops the
// connection, which is why the limit is generous and documented).
TEST(LimitsTest, MetadataUpToTheLimitIsAcceptedBeyondItRefused) {
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon, Daemon::Start());
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  MHC_ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse info, c->GetServerInfo());
  const uint64_t limit = info.limits().max_metadata_bytes();
  ASSERT_GT(limit, uint64_t{8} << 10);

  auto call_with_metadata = [&](uint64_t bytes) {
    grpc::ClientContext context;
    context.AddMetadata("x-test-padding", std::string(bytes, 'a'));
    v1::GetServerInfoResponse response;
    return c->stub()->GetServerInfo(&context, v1::GetServerInfoRequest(),
                                    &response);
  };
  // Well over gRPC's default, under the daemon's limit.
  grpc::Status accepted = call_with_metadata(limit / 2);
  EXPECT_TRUE(accepted.ok()) << accepted.error_message();
  grpc::Status refused = call_with_metadata(limit + 1024);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.error_message();
  // The client can go on, on a new connection: the first call may still
  // see the dropped one (UNAVAILABLE), which clients retry.
  absl::Status again = c->GetServerInfo().status();
  for (int attempt = 0; absl::IsUnavailable(again) && attempt < 50; ++attempt) {
    absl::SleepFor(absl::Milliseconds(100));
    again = c->GetServerInfo().status();
  }
  MHC_ASSERT_OK(again);
}

}  // namespace
}  // namespace mhc::testing
