// The run maps of the dx / dphi kernel (kernels/cuda/projection/run_maps.h)
// on the host: every stage of every CTA lands as the kernel asks for it
// (each box simulated as a tensor copy would read it, zeros out of bounds),
// and every channel of every token and stream is read back from where the
// kernel looks for it. The copies' own rules are checked on the way: map
// strides, box starts and shared-memory destinations on their alignment, no
// read past the tensor, no two boxes landing on one element.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "projection/run_maps.h"

namespace mhc::cuda::proj {
namespace {

constexpr int64_t kUnwritten = -1;

// A row-major tensor of `tokens` rows of `width` elements; element i holds
// i + 1, so that a zero can only come from the copies' out-of-bounds fill.
struct Tensor {
  int64_t tokens, width;
  int64_t At(int64_t i) const { return i + 1; }
};

// One 2-d tensor copy of `map` (based on the tensor) at (inner, row) into
// landed[dst ..], box {kDxLandElems, box_rows}. Returns false on a broken
// rule, with the reason in `why`.
bool Copy(const Tensor& t, const DxRunMap& map, int64_t inner, int64_t row,
          int box_rows, std::vector<int64_t>& landed, int64_t dst,
          std::string& why) {
  if (map.stride_bytes % 16 != 0) return why = "row stride off 16", false;
  if (inner * 2 % 16 != 0) return why = "box starts off 16 bytes", false;
  if (dst * 2 % kDxLandAlignBytes != 0) return why = "destination", false;
  const int64_t stride = map.stride_bytes / 2;
  for (int r = 0; r < box_rows; ++r) {
    for (int e = 0; e < kDxLandElems; ++e) {
      const int64_t at = dst + int64_t{r} * kDxLandElems + e;
      if (at < 0 || at >= static_cast<int64_t>(landed.size())) {
        return why = "lands outside the stage", false;
      }
      if (landed[at] != kUnwritten) return why = "two boxes overlap", false;
      const int64_t ci = inner + e, cr = row + r;
      int64_t value = 0;
      if (ci < map.inner && cr < map.rows) {
        const int64_t i = cr * stride + ci;
        if (i >= t.tokens * t.width) return why = "read past the tensor", false;
        value = t.At(i);
      }
      landed[at] = value;
    }
  }
  return true;
}

// Lands one stage of one CTA of a tensor with `streams` runs per token (x:
// 4 of C channels in rows of 4 C; dy: 1 in rows of C) and checks every
// channel where the kernel reads it.
void CheckStage(int64_t C, int streams, int64_t tokens, int64_t c0, int64_t m0,
                int tile_bytes) {
  const Tensor t{tokens, streams * C};
  const int group = DxRowGroup(t.width);
  ASSERT_EQ(kDxStageTokens % group, 0);
  ASSERT_EQ(m0 % kDxStageTokens, 0);
  std::vector<int64_t> landed(tile_bytes / 2, kUnwritten);
  std::string why;
  const std::string where = "C " + std::to_string(C) + " streams " +
                            std::to_string(streams) + " M " +
                            std::to_string(tokens) + " c0 " +
                            std::to_string(c0) + " m0 " + std::to_string(m0);
  // The kernel's issue: a box per (stream, residue), its first token the
  // residue's.
  for (int i = 0; i < streams; ++i) {
    for (int r = 0; r < group; ++r) {
      const DxRunMap map = DxRunMapOf(tokens, t.width, group, r);
      ASSERT_GE(map.rows, 1) << where;
      const int64_t coord = DxRunCoordinate(group, r, t.width, i * C + c0);
      ASSERT_TRUE(Copy(t, map, coord - DxRunOffset(coord), m0 / group,
                       kDxStageTokens / group, landed, DxLandRow(group, i, r),
                       why))
          << why << ": " << where << " stream " << i << " residue " << r;
    }
  }
  // The kernel's reads: token, stream, channel.
  for (int tok = 0; tok < kDxStageTokens; ++tok) {
    for (int i = 0; i < streams; ++i) {
      const int64_t coord = DxRunCoordinate(group, tok, t.width, i * C + c0);
      const int at = DxLandRow(group, i, tok) + DxRunOffset(coord);
      ASSERT_GE(DxRunOffset(coord), 0);
      ASSERT_LE(DxRunOffset(coord) + kDxRunChannels, kDxLandElems);
      for (int c = 0; c < kDxRunChannels && c0 + c < C; ++c) {
        const int64_t token = m0 + tok;
        const int64_t want =
            token < tokens ? t.At(token * t.width + i * C + c0 + c) : 0;
        ASSERT_EQ(landed[at + c], want)
            << where << " token " << tok << " stream " << i << " channel " << c;
      }
    }
  }
}

void CheckLayer(int64_t C, int64_t tokens) {
  for (int64_t c0 = 0; c0 < C; c0 += kDxRunChannels) {
    for (int64_t m0 = 0; m0 < tokens; m0 += kDxStageTokens) {
      CheckStage(C, 4, tokens, c0, m0, kDxLandTileBytes);
      CheckStage(C, 1, tokens, c0, m0, kDxLandDyBytes);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(DxRunMaps, GroupsSpanWholeSixteenBytes) {
  EXPECT_EQ(DxRowGroup(5129), 8);
  EXPECT_EQ(DxRowGroup(4 * 5129), 2);
  EXPECT_EQ(DxRowGroup(1030), 4);
  EXPECT_EQ(DxRowGroup(4 * 1030), 1);
  EXPECT_EQ(DxRowGroup(1036), 2);
  EXPECT_EQ(DxRowGroup(5120), 1);
  for (int64_t width = 1; width < 200; ++width) {
    const int g = DxRowGroup(width);
    EXPECT_EQ(width * 2 * g % 16, 0) << width;
    if (g > 1) {
      EXPECT_NE(width * 2 * (g / 2) % 16, 0) << "fewer rows do";
    }
  }
}

TEST(DxRunMaps, StagesFitTheirTiles) {
  EXPECT_EQ(kDxLandStageBytes % kDxLandAlignBytes, 0);
  EXPECT_EQ(kDxLandTileBytes % kDxLandAlignBytes, 0);
  for (int g : {1, 2, 4, 8}) {
    EXPECT_EQ(DxLandBlockBytes(g) % kDxLandAlignBytes, 0);
    EXPECT_GE(DxLandBlockBytes(g), kDxStageTokens / g * kDxLandElems * 2);
  }
}

// Every class of C modulo 8 (odd, 2 and 4 modulo 8, whole vectors), a
// partial last CTA of channels, an odd M with a partial last stage, and the
// fewest tokens a launch with run maps takes.
TEST(DxRunMaps, EveryChannelLandsWhereTheKernelReadsIt) {
  for (int64_t C : {5129, 1030, 1036, 1027, 1031, 4100, 64, 33, 7}) {
    for (int64_t tokens : {kDxRunMapMinTokens, int64_t{9}, int64_t{67}}) {
      CheckLayer(C, tokens);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(DxRunMaps, LongerBatches) {
  CheckLayer(5129, 1000);
  CheckLayer(1030, 129);
}

}  // namespace
}  // namespace mhc::cuda::proj
