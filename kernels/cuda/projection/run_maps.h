// Where the tensor-copy boxes of the dx / dphi kernel's run maps read and
// land (backward/mma.cuh, DxRowCopy::kRunMaps). Plain C++ without CUDA, so
// that a host test can walk every element through it.
//
// A tensor map needs its base and row stride on 16 bytes, and a box must
// start on 16 bytes too. Rows of 16-bit elements off 16 bytes (odd C) break
// both, but only periodically: `group` consecutive rows of `width` elements
// span a multiple of 16 bytes, so every token of one residue modulo the
// group sees each of its 32-channel runs the same offset past 16 bytes. A
// residue therefore gets a map of its own rows: based on the tensor, rows
// `group` tokens apart, `(residue + 1) * width` elements wide so that a box
// never reads past its own token's row (the bytes past the last token are
// out of bounds, zero filled). A run lands as the box of kDxLandElems
// elements that starts on the 16 bytes at or before its first channel, its
// channels `offset` elements into the landed row.
#ifndef MHC_KERNELS_CUDA_PROJECTION_RUN_MAPS_H_
#define MHC_KERNELS_CUDA_PROJECTION_RUN_MAPS_H_

#include <cstdint>

#include "projection/geometry.h"

namespace mhc::cuda::proj {

inline constexpr int kDxRunChannels = kDxCols / 4;  // a stream's run (n = 4)
inline constexpr int kDxLandElems = kDxRunChannels + 8;  // and 16 bytes
// Tensor-copy destinations in shared memory sit on 128 bytes.
inline constexpr int kDxLandAlignBytes = 128;
// Every residue map has a row from this many tokens (groups are <= 8).
inline constexpr int64_t kDxRunMapMinTokens = 8;

// The fewest rows of `width` 16-bit elements that span a multiple of 16
// bytes: 1, 2, 4 or 8.
constexpr int DxRowGroup(int64_t width) {
  int group = 1;
  while (width * 2 * group % 16 != 0) group *= 2;
  return group;
}

// Bytes of one residue's landed rows in a stage (kDxStageTokens / group
// rows of kDxLandElems), rounded to the copy destinations' alignment.
constexpr int DxLandBlockBytes(int group) {
  const int bytes = kDxStageTokens / group * kDxLandElems * 2;
  return (bytes + kDxLandAlignBytes - 1) / kDxLandAlignBytes *
         kDxLandAlignBytes;
}

// An activation tile (x, dx_next: 4 streams, rows of K = 4 C, a group of 1
// or 2) and the dy tile (one stream, rows of C, a group up to 8) as landed,
// each sized for its largest group.
inline constexpr int kDxLandTileBytes = 4 * 2 * DxLandBlockBytes(2);
inline constexpr int kDxLandDyBytes = 8 * DxLandBlockBytes(8);
inline constexpr int kDxLandStageBytes = 2 * kDxLandTileBytes + kDxLandDyBytes;
static_assert(4 * DxLandBlockBytes(1) <= kDxLandTileBytes &&
                  DxLandBlockBytes(1) <= kDxLandDyBytes &&
                  2 * DxLandBlockBytes(2) <= kDxLandDyBytes &&
                  4 * DxLandBlockBytes(4) <= kDxLandDyBytes,
              "every group's blocks fit their tile");

// The element (from its tile's start) where the landed row of stage token
// `token` (0 .. kDxStageTokens - 1) of `stream` starts. Stages start on a
// multiple of kDxStageTokens, so a stage token's residue is the token's.
constexpr int DxLandRow(int group, int stream, int token) {
  return (stream * group + token % group) * (DxLandBlockBytes(group) / 2) +
         token / group * kDxLandElems;
}

// A run's first channel, as the element coordinate inside the rows of its
// residue's map: residue * width (the earlier tokens of the group) plus the
// run's place in its token's row (stream * C + first channel).
constexpr int64_t DxRunCoordinate(int group, int token, int64_t width,
                                  int64_t in_row) {
  return token % group * width + in_row;
}
// How far the run's first channel sits past the 16 bytes its box starts on
// (the map rows start on 16 bytes).
constexpr int DxRunOffset(int64_t coordinate) {
  return static_cast<int>(coordinate % 8);
}

// The residue map of `group`-token rows for residue r: its dimensions
// {inner, rows} and row stride in bytes, for `tokens` rows of `width`.
struct DxRunMap {
  int64_t inner = 0;
  int64_t rows = 0;
  int64_t stride_bytes = 0;
};
constexpr DxRunMap DxRunMapOf(int64_t tokens, int64_t width, int group, int r) {
  DxRunMap m;
  m.inner = (r + 1) * width;
  m.rows = (tokens - r + group - 1) / group;
  m.stride_bytes = group * width * 2;
  return m;
}

}  // namespace mhc::cuda::proj

#endif  // MHC_KERNELS_CUDA_PROJECTION_RUN_MAPS_H_
