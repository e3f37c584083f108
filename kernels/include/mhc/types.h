// Vocabulary of the kernels: dtypes, layouts, the layer spec and its presets.
// Plain data, no behaviour beyond shape helpers.
#ifndef MHC_TYPES_H_
#define MHC_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mhc {

// Activation dtypes. Parameters and mixing values are always fp32.
enum class DType : uint8_t { kF32 = 1, kF16 = 2, kBF16 = 3 };

// STREAM_MAJOR: element (m,i,c) at m*K + i*C + c. STREAM_MINOR: m*K + c*n + i.
enum class Layout : uint8_t { kStreamMajor = 1, kStreamMinor = 2 };

// Which index of H_res is the source stream in post (docs/SPEC.md section 2).
enum class Orientation : uint8_t { kSourceRows = 1, kDestRows = 2 };

enum class SinkhornMode : uint8_t { kLinear = 1, kLog = 2 };

// Where eps_rms enters the RMS: 1/sqrt(ms + eps) or 1/(sqrt(ms) + eps).
enum class EpsPlacement : uint8_t { kInside = 1, kOutside = 2 };

// Precision of the projection's dot products on tensor-core backends; CPU
// backends always compute at least IEEE fp32.
enum class MatmulPrecision : uint8_t { kIeee = 1, kTf32 = 2 };

// kMhc: a full mHC layer (pre + post). kHead: the last-layer contraction
// (docs/SPEC.md's "head"), whose parameters reuse the same slots: phi [n, K],
// alpha [1] holding the scalar s, beta [n] holding b_head, optional gamma [K].
enum class LayerKind : uint8_t { kMhc = 1, kHead = 2 };

size_t DTypeSize(DType dtype);
absl::string_view DTypeName(DType dtype);
absl::string_view LayoutName(Layout layout);

struct LayerSpec {
  LayerKind kind = LayerKind::kMhc;
  int n = 4;           // residual streams, 1..16
  int64_t hidden = 0;  // C, width of one stream, >= 1
  Layout layout = Layout::kStreamMajor;
  Orientation orientation = Orientation::kSourceRows;
  SinkhornMode sinkhorn_mode = SinkhornMode::kLinear;
  int sinkhorn_iterations = 20;  // T, 1..1000
  float eps_sk = 1e-6f;          // LINEAR only
  float eps_rms = 1e-6f;
  EpsPlacement eps_placement = EpsPlacement::kInside;
  float eps_pre = 1e-6f;
  float post_mult = 2.0f;
  bool dynamic = true;  // false: z = beta for every token (no phi/alpha/gamma)
  bool has_gamma = false;
  bool has_post_bias = false;
  MatmulPrecision matmul_precision = MatmulPrecision::kTf32;

  int64_t K() const { return static_cast<int64_t>(n) * hidden; }
  // Rows of phi / logits per token: 2n + n*n for kMhc, n for kHead.
  int64_t NumLogits() const {
    return kind == LayerKind::kHead ? n : 2 * static_cast<int64_t>(n) + n * n;
  }
  // Number of alpha gates: 3 (pre, post, res) for kMhc, 1 (s) for kHead.
  int NumAlpha() const { return kind == LayerKind::kHead ? 1 : 3; }
  // Offset of element (stream i, channel c) inside one token of x.
  int64_t XIndex(int i, int64_t c) const {
    return layout == Layout::kStreamMajor ? i * hidden + c : c * n + i;
  }
};

// Limits every backend and the server enforce.
inline constexpr int kMaxStreams = 16;
inline constexpr int kMaxSinkhornIterations = 1000;

// Names of the presets of docs/SPEC.md section 5, default first.
const std::vector<std::string>& PresetNames();
// The spec of a named preset with the given n and C (other fields as
// docs/SPEC.md section 5). NOT_FOUND-style INVALID_ARGUMENT for an unknown
// name.
absl::StatusOr<LayerSpec> PresetSpec(absl::string_view name, int n,
                                     int64_t hidden);
// Checks every field's range; the message names the field.
absl::Status ValidateSpec(const LayerSpec& spec);

// Product of dims, or an error when a dim is negative or the product
// overflows int64 (or exceeds `limit`).
absl::StatusOr<int64_t> CheckedElementCount(const std::vector<int64_t>& dims,
                                            int64_t limit = INT64_MAX);

}  // namespace mhc

#endif  // MHC_TYPES_H_
