// The pieces of SetParametersStream against one layer: what a valid stream
// assembles, and each way a piece or a stream is refused.
#include "server/parameter_stream.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace mhc::server {
namespace {

LayerSpec SmallSpec() {
  LayerSpec spec;
  spec.n = 2;
  spec.hidden = 4;
  return spec;
}

class ParameterStreamTest : public ::testing::Test {
 protected:
  // Parameter checks need no device: the layer is never allocated.
  ParameterStreamTest() : layer_("l", "", SmallSpec(), nullptr) {}

  const Layer::Param& Param(const std::string& name) const {
    return *layer_.FindParam(name);
  }
  static uint64_t Bytes(const Layer::Param& param) {
    return static_cast<uint64_t>(param.elements) * 4;
  }

  // A piece of `param` holding `bytes` bytes of `fill` from `offset`.
  v1::ParameterChunk Piece(const std::string& name, uint64_t offset,
                           uint64_t bytes, char fill = 'x') const {
    v1::ParameterChunk chunk;
    chunk.set_name(name);
    for (int64_t d : Param(name).shape) chunk.add_shape(d);
    chunk.set_dtype(v1::DTYPE_F32);
    chunk.set_offset(offset);
    chunk.set_data(std::string(bytes, fill));
    return chunk;
  }

  // The status of the first piece refused, or of Finish.
  absl::Status Run(const std::vector<v1::ParameterChunk>& pieces) const {
    ParameterStreamAssembler assembler(layer_);
    for (const v1::ParameterChunk& piece : pieces) {
      if (absl::Status s = assembler.Add(piece); !s.ok()) return s;
    }
    return assembler.Finish();
  }

  Layer layer_;
};

TEST_F(ParameterStreamTest, PiecesInOrderMakeWholeTensors) {
  const uint64_t beta = Bytes(Param("beta"));
  ParameterStreamAssembler assembler(layer_);
  v1::ParameterChunk first = Piece("beta", 0, 8, 'a');
  first.set_layer("l");
  ASSERT_TRUE(assembler.Add(first).ok());
  ASSERT_TRUE(assembler.Add(Piece("beta", 8, beta - 8, 'b')).ok());
  v1::ParameterChunk alpha = Piece("alpha", 0, Bytes(Param("alpha")), 'c');
  alpha.set_layer("l");  // repeating the layer is fine
  ASSERT_TRUE(assembler.Add(alpha).ok());
  ASSERT_TRUE(assembler.Finish().ok());
  const std::vector<ParameterUpdate> updates = assembler.Updates();
  ASSERT_EQ(updates.size(), 2u);
  EXPECT_EQ(updates[0].param, &Param("beta"));
  EXPECT_EQ(updates[0].bytes, std::string(8, 'a') + std::string(beta - 8, 'b'));
  EXPECT_EQ(updates[1].param, &Param("alpha"));
  EXPECT_EQ(updates[1].bytes, std::string(Bytes(Param("alpha")), 'c'));
}

TEST_F(ParameterStreamTest, EveryBrokenStreamIsRefused) {
  const uint64_t beta = Bytes(Param("beta"));
  const uint64_t alpha = Bytes(Param("alpha"));
  auto with = [&](v1::ParameterChunk chunk, auto change) {
    change(chunk);
    return chunk;
  };
  struct Case {
    const char* what;
    std::vector<v1::ParameterChunk> pieces;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"another layer",
       {with(Piece("beta", 0, beta),
             [](v1::ParameterChunk& c) { c.set_layer("other"); })},
       "the stream is for layer 'l'"},
      {"an unknown parameter",
       {with(Piece("beta", 0, beta),
             [](v1::ParameterChunk& c) { c.set_name("nope"); })},
       "no parameter 'nope'"},
      {"bf16",
       {with(Piece("beta", 0, beta),
             [](v1::ParameterChunk& c) { c.set_dtype(v1::DTYPE_BF16); })},
       "expected DTYPE_F32"},
      {"another shape",
       {with(Piece("beta", 0, beta),
             [](v1::ParameterChunk& c) { c.add_shape(1); })},
       ".shape: expected"},
      {"a gap",
       {Piece("beta", 0, 4), Piece("beta", 8, beta - 8)},
       "does not continue"},
      {"an overlap",
       {Piece("beta", 0, 8), Piece("beta", 4, beta - 4)},
       "does not continue"},
      {"bytes past the end", {Piece("beta", 0, beta + 4)}, "run past its"},
      {"a tensor twice",
       {Piece("beta", 0, beta), Piece("alpha", 0, alpha),
        Piece("beta", 0, beta)},
       "came again"},
      {"a tensor left incomplete",
       {Piece("beta", 0, 4), Piece("alpha", 0, alpha)},
       "moved on after 4"},
      {"a stream ending inside a tensor",
       {Piece("alpha", 0, alpha - 4)},
       "the stream ended after"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const absl::Status status = Run(c.pieces);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), c.message)) << status;
  }
}

}  // namespace
}  // namespace mhc::server
