// mhc_client's host-side helpers: tensor conversions and rounding, address
// parsing, spec conversion and the error measures used by mhcctl run.
#include <cmath>
#include <vector>

#include "convert/spec_convert.h"
#include "gtest/gtest.h"
#include "mhc/client/client.h"
#include "mhc/client/compare.h"
#include "mhc/client/spec.h"
#include "mhc/client/tensor.h"

namespace mhc::client {
namespace {

TEST(ClientTensorTest, Bf16AndFp16RoundToNearestEven) {
  // 1 + 2^-8 lies halfway between two bf16 values: ties go to the even one.
  // 1 + 3 * 2^-9 is above the midpoint and rounds up.
  const float values[] = {1.0f + std::ldexp(1.0f, -8),
                          1.0f + 3 * std::ldexp(1.0f, -9), -2.5f, 65504.0f};
  HostTensor bf16 = FromFloats(DType::kBF16, {4}, values);
  EXPECT_EQ(bf16.bytes.size(), 8u);
  EXPECT_EQ(bf16.Get(0), 1.0f);
  EXPECT_EQ(bf16.Get(1), 1.0f + std::ldexp(1.0f, -7));
  EXPECT_EQ(bf16.Get(2), -2.5f);
  // fp16: 1 + 2^-11 is a tie (to 1), 1 + 3 * 2^-12 rounds up; 65504 is max.
  const float half_values[] = {1.0f + std::ldexp(1.0f, -11),
                               1.0f + 3 * std::ldexp(1.0f, -12), -2.5f,
                               65520.0f};
  HostTensor fp16 = FromFloats(DType::kF16, {4}, half_values);
  EXPECT_EQ(fp16.Get(0), 1.0f);
  EXPECT_EQ(fp16.Get(1), 1.0f + std::ldexp(1.0f, -10));
  EXPECT_TRUE(std::isinf(fp16.Get(3))) << "65520 rounds to infinity";
}

TEST(ClientTensorTest, TensorRefRoundTripAndValidation) {
  HostTensor t = RandomTensor(DType::kBF16, {2, 3, 5}, 42);
  v1::TensorRef ref = ToTensorRef(t);
  EXPECT_EQ(ref.dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(ref.shape_size(), 3);
  auto back = FromTensorRef(ref);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->bytes, t.bytes);
  EXPECT_EQ(back->shape, t.shape);

  ref.mutable_inline_data()->pop_back();
  EXPECT_EQ(FromTensorRef(ref).status().code(),
            absl::StatusCode::kInvalidArgument);
  ref = ToTensorRef(t);
  ref.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_FALSE(FromTensorRef(ref).ok());
  ref = ToTensorRef(t);
  ref.set_ref("op.y");
  EXPECT_FALSE(FromTensorRef(ref).ok());
  EXPECT_EQ(ParseDType("fp32").value_or(DType::kBF16), DType::kF32);
  EXPECT_FALSE(ParseDType("int8").ok());
}

TEST(ClientTest, AddressesAndStatusCodes) {
  EXPECT_TRUE(NormalizeAddress("127.0.0.1:50051").ok());
  EXPECT_TRUE(NormalizeAddress("unix:/tmp/x.sock").ok());
  EXPECT_TRUE(NormalizeAddress("[::1]:7").ok());
  EXPECT_FALSE(NormalizeAddress("").ok());
  EXPECT_FALSE(NormalizeAddress("unix:").ok());
  EXPECT_FALSE(NormalizeAddress("localhost").ok());
  absl::Status s =
      FromGrpcStatus(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "x"));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "x");
}

TEST(ClientSpecTest, ProtoRoundTripAndNames) {
  auto spec = PresetSpec("transformer_engine", 4, 12);
  ASSERT_TRUE(spec.ok());
  spec->has_gamma = true;
  auto back = SpecFromProto(SpecToProto(*spec));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(SpecToProto(*back).SerializeAsString(),
            SpecToProto(*spec).SerializeAsString());
  v1::LayerSpec unresolved = SpecToProto(*spec);
  unresolved.clear_sinkhorn_iterations();
  EXPECT_FALSE(SpecFromProto(unresolved).ok());
  EXPECT_EQ(ParseLayout("stream_minor").value_or(v1::LAYOUT_UNSPECIFIED),
            v1::LAYOUT_STREAM_MINOR);
  EXPECT_EQ(ParseOrientation("DEST_ROWS").value_or(v1::ORIENTATION_UNSPECIFIED),
            v1::ORIENTATION_DEST_ROWS);
  EXPECT_FALSE(ParseSinkhornMode("unspecified").ok());
  EXPECT_FALSE(ParseEpsPlacement("middle").ok());
  auto shapes = ParameterShapes(*spec);
  EXPECT_EQ(shapes["phi"], (std::vector<int64_t>{24, 48}));
  EXPECT_EQ(shapes["gamma"], (std::vector<int64_t>{48}));
  EXPECT_EQ(shapes.count("bias"), 0u);
}

TEST(ClientCompareTest, RelativeErrorWithScaleFloor) {
  std::vector<float> want = {10.0f, -5.0f, 0.001f};
  std::vector<float> got = {10.01f, -5.0f, 0.002f};
  Comparison c = Compare(got, want);
  // 0.001 off at 0.001 counts against 10% of 10, not against 0.001.
  EXPECT_NEAR(c.error, 1e-3, 1e-6);
  EXPECT_EQ(c.worst_index, 0);
  EXPECT_TRUE(c.Within(2e-3));
  EXPECT_FALSE(c.Within(5e-4));
  got[1] = NAN;
  EXPECT_FALSE(Compare(got, want).Within(1.0));
  EXPECT_FALSE(Compare({1.0f}, {1.0f, 2.0f}).Within(1.0));
  // Column sums of two 2x2 matrices: the second has a column summing to 1.5.
  std::vector<float> h = {0.5f, 0.5f, 0.5f, 0.5f, 1.0f, 0.0f, 0.5f, 1.0f};
  EXPECT_NEAR(MaxColumnSumError(h, 2), 0.5, 1e-12);
}

}  // namespace
}  // namespace mhc::client
