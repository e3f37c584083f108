// Limits over a real mhcd: layers larger than --max_message_bytes come
// back through StreamParameters/StreamGradients, bit for bit, and go in
// through SetParametersStream, all or nothing; and request
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

// New values for every parameter of `current`, of the same shapes.
v1::SetParametersRequest RandomParameters(const std::string& layer,
                                          const v1::Parameters& current) {
  v1::SetParametersRequest request;
  request.set_layer(layer);
  for (const auto& [name, tensor] : current.tensors()) {
    (*request.mutable_parameters()->mutable_tensors())[name] =
        client::ToTensorRef(RandomF32(std::vector<int64_t>(
            tensor.shape().begin(), tensor.shape().end())));
  }
  return request;
}

TEST(LimitsTest, LayersLargerThanTheMessageLimitAreSetInPieces) {
  MHC_ASSERT_OK_AND_ASSIGN(auto daemon,
                           Daemon::Start({absl::StrCat("--max_message_bytes=",
                                                       kSmallMessageBytes)}));
  MHC_ASSERT_OK_AND_ASSIGN(auto c, daemon->Connect());
  MHC_ASSERT_OK_AND_ASSIGN(v1::LayerInfo created,
                           c->CreateLayer(LayerRequest("big", kN, kHidden)));
  MHC_ASSERT_OK_AND_ASSIGN(v1::Parameters before, c->StreamParameters("big"));
  const v1::SetParametersRequest update = RandomParameters("big", before);

  EXPECT_EQ(c->SetParameters(update).status().code(),
            absl::StatusCode::kResourceExhausted);
  MHC_ASSERT_OK_AND_ASSIGN(v1::LayerInfo info, c->SetParametersStream(update));
  EXPECT_EQ(info.parameters_version(), created.parameters_version() + 1);
  MHC_ASSERT_OK_AND_ASSIGN(v1::Parameters after, c->StreamParameters("big"));
  ExpectSameTensors(update.parameters(), after);

  // A stream with one bad tensor changes nothing, not even the tensors
  // before it.
  v1::SetParametersRequest broken = RandomParameters("big", before);
  (*broken.mutable_parameters()->mutable_tensors())["phi"].add_shape(1);
  EXPECT_EQ(c->SetParametersStream(broken).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Nor does a stream that breaks off after every piece but before its end.
  {
    grpc::ClientContext context;
    v1::LayerInfo ignored;
    auto writer = c->stub()->SetParametersStream(&context, &ignored);
    v1::SetParametersRequest complete = RandomParameters("big", before);
    for (const auto& [name, tensor] : complete.parameters().tensors()) {
      v1::ParameterChunk chunk;
      chunk.set_layer("big");
      chunk.set_name(name);
      *chunk.mutable_shape() = tensor.shape();
      chunk.set_dtype(v1::DTYPE_F32);
      chunk.set_data(tensor.inline_data());
      if (chunk.ByteSizeLong() < static_cast<size_t>(kSmallMessageBytes)) {
        ASSERT_TRUE(writer->Write(chunk));
      }
    }
    // Time for the daemon to read every piece, so that only the broken
    // call stands between them and the layer.
    absl::SleepFor(absl::Milliseconds(200));
    context.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  MHC_ASSERT_OK_AND_ASSIGN(v1::LayerInfo unchanged, c->GetLayer("big"));
  EXPECT_EQ(unchanged.parameters_version(), info.parameters_version());
  MHC_ASSERT_OK_AND_ASSIGN(v1::Parameters still, c->StreamParameters("big"));
  ExpectSameTensors(update.parameters(), still);

  // Pieces larger than the daemon's limit are refused as any message is.
  EXPECT_EQ(c->SetParametersStream(update, kSmallMessageBytes).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(
      c->SetParametersStream(RandomParameters("none", before)).status().code(),
      absl::StatusCode::kNotFound);
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
