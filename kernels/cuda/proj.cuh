// The projection of a tile of kTileTokens tokens inside one CTA: h = phi' v
// for every logit row and the sum of squares, read from x in one pass per
// kRowsPerPass rows (one pass in total for n = 4). Each thread walks a fixed
// set of flat k positions in increasing order, then BlockSum adds the
// threads in a fixed tree: a token's h and mean square depend only on K and
// the block shape, never on M or on which tile slot the token sits in.
#ifndef MHC_KERNELS_CUDA_PROJ_CUH_
#define MHC_KERNELS_CUDA_PROJ_CUH_

#include "common.cuh"

namespace mhc::cuda {

inline constexpr int kProjWidth = kTileTokens * kRowsPerPass + kTileTokens;

// Shared memory of one projection tile.
struct ProjShared {
  float h[kTileTokens * kMaxLogits];  // h[t * kMaxLogits + g]
  float ms[kTileTokens];              // mean square
  float red[kProjWidth * (kTileThreads / 32)];
  float total[kProjWidth];
};

// VK: consecutive k per thread step (2 needs K even and aligned rows).
template <typename T, int VK>
__device__ void ProjectTile(const DevSpec& s, const T* x, int64_t m0,
                            int64_t tokens, const float* phi,
                            const float* gamma, ProjShared& sh) {
  constexpr int kTm = kTileTokens;
  constexpr int kGb = kRowsPerPass;
  for (int g0 = 0; g0 < s.N; g0 += kGb) {
    float acc[kProjWidth];
#pragma unroll
    for (int w = 0; w < kProjWidth; ++w) acc[w] = 0.0f;
    for (int64_t k = threadIdx.x * VK; k < s.K;
         k += static_cast<int64_t>(blockDim.x) * VK) {
      float xv[kTm][VK];
#pragma unroll
      for (int t = 0; t < kTm; ++t) {
        if (m0 + t < tokens) {
          LoadVec<T, VK>(x + (m0 + t) * s.K + k, xv[t]);
        } else {
#pragma unroll
          for (int v = 0; v < VK; ++v) xv[t][v] = 0.0f;
        }
      }
      if (g0 == 0) {
#pragma unroll
        for (int t = 0; t < kTm; ++t) {
#pragma unroll
          for (int v = 0; v < VK; ++v) {
            acc[kTm * kGb + t] = fmaf(xv[t][v], xv[t][v], acc[kTm * kGb + t]);
          }
        }
      }
      float gm[VK];
      if (s.has_gamma) {
        LoadVec<float, VK>(gamma + k, gm);
      }
#pragma unroll
      for (int g = 0; g < kGb; ++g) {
        if (g0 + g >= s.N) break;
        float ph[VK];
        LoadVec<float, VK>(phi + (g0 + g) * s.K + k, ph);
        if (s.has_gamma) {
#pragma unroll
          for (int v = 0; v < VK; ++v) ph[v] *= gm[v];
        }
#pragma unroll
        for (int t = 0; t < kTm; ++t) {
#pragma unroll
          for (int v = 0; v < VK; ++v) {
            acc[t * kGb + g] = fmaf(ph[v], xv[t][v], acc[t * kGb + g]);
          }
        }
      }
    }
    BlockSum<kProjWidth>(acc, sh.red, sh.total);
    for (int w = threadIdx.x; w < kProjWidth; w += blockDim.x) {
      if (w < kTm * kGb) {
        const int t = w / kGb;
        const int g = w % kGb;
        if (g0 + g < s.N) sh.h[t * kMaxLogits + g0 + g] = sh.total[w];
      } else if (g0 == 0) {
        sh.ms[w - kTm * kGb] = sh.total[w] / static_cast<float>(s.K);
      }
    }
    __syncthreads();
  }
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PROJ_CUH_
