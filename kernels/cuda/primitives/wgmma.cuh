// Warpgroup matrix multiplies (sm_90a wgmma) of TF32 operands (B in shared
// memory, A in shared memory or registers) and of bf16 operands (both in
// shared memory), and the layout they read.
//
// Operand layout (A: one row per output row, B: one row per output column):
// K-major rows of 32 fp32 or 64 bf16 (128 bytes), 128-byte swizzle: 16-byte
// chunk c of row r lives at chunk c ^ (r % 8), in atoms of 8 rows (1024
// bytes, 1024-aligned). A descriptor names the row the instruction starts at
// and its k offset inside the 128-byte row; the hardware applies the same
// XOR to the address it forms, so k steps (8 tf32 or 16 bf16: 32 bytes)
// only add to the start.
//
// Accumulators: a warpgroup computes 64 rows; warp w of it holds rows 16 w ..
// 16 w + 15 in the m16n8 fragment layout (per 8 columns j: rows grp and
// grp + 8, columns 8 j + 2 quad and 8 j + 2 quad + 1).
#ifndef MHC_KERNELS_CUDA_PRIMITIVES_WGMMA_CUH_
#define MHC_KERNELS_CUDA_PRIMITIVES_WGMMA_CUH_

#include <cstdint>

namespace mhc::cuda {

inline constexpr int kSwizzleAtomBytes = 1024;

// The first atom boundary at or after dynamic shared memory's start, which
// is only 16-byte aligned (the kernels' plans reserve an atom for this).
template <typename E>
__device__ __forceinline__ E* AtomAligned(E* smem) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t skip =
      (kSwizzleAtomBytes - at % kSwizzleAtomBytes) % kSwizzleAtomBytes;
  return reinterpret_cast<E*>(reinterpret_cast<char*>(smem) + skip);
}

// Byte offset of 16-byte chunk c of operand row r.
__device__ __forceinline__ int SwizzledChunkAt(int r, int c) {
  return r * 128 + ((c ^ (r & 7)) << 4);
}

// Where fp32 element k (of 32) of operand row r lives, in floats.
__device__ __forceinline__ int SwizzledRow(int r, int k) {
  return (SwizzledChunkAt(r, k >> 2) >> 2) + (k & 3);
}

// Descriptor of a K-major, 128-byte-swizzled operand whose first row starts
// at shared address `tile` (1024-aligned); DescriptorPlus moves it on.
__device__ __forceinline__ uint64_t SwizzledDescriptor(const void* tile) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
  constexpr uint64_t kLeading = 1;  // unused by swizzled K-major layouts
  constexpr uint64_t kStride = kSwizzleAtomBytes >> 4;  // between 8-row atoms
  constexpr uint64_t kSwizzle128 = 1;
  return static_cast<uint64_t>((at & 0x3ffff) >> 4) | (kLeading << 16) |
         (kStride << 32) | (kSwizzle128 << 62);
}

// The descriptor of the same operand `bytes` further on (a multiple of 16
// that keeps the start inside shared memory: the address field cannot
// carry).
__device__ __forceinline__ uint64_t DescriptorPlus(uint64_t desc, int bytes) {
  return desc + static_cast<uint64_t>(bytes >> 4);
}

// Orders this thread's accumulator writes before the wgmmas that read them.
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending)
               : "memory");
}
// Makes this thread's generic-proxy shared-memory writes visible to the
// wgmmas (async proxy) that follow a barrier.
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The wgmma wrappers below. Inline asm takes only literal operand lists, so
// each width is spelled out by these macros: MHC_WGMMA_D<n> the accumulator
// operands d[0 .. n-1], MHC_WGMMA_R<n> their names %0 .. %n-1.
#define MHC_WGMMA_D8(i)                                                       \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
      "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define MHC_WGMMA_D12 \
  MHC_WGMMA_D8(0), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
#define MHC_WGMMA_D16 MHC_WGMMA_D8(0), MHC_WGMMA_D8(8)
#define MHC_WGMMA_D32 MHC_WGMMA_D16, MHC_WGMMA_D8(16), MHC_WGMMA_D8(24)
#define MHC_WGMMA_D40                                                   \
  MHC_WGMMA_D8(0), MHC_WGMMA_D8(8), MHC_WGMMA_D8(16), MHC_WGMMA_D8(24), \
      MHC_WGMMA_D8(32)
#define MHC_WGMMA_D48 MHC_WGMMA_D40, MHC_WGMMA_D8(40)
#define MHC_WGMMA_D64 MHC_WGMMA_D48, MHC_WGMMA_D8(48), MHC_WGMMA_D8(56)
#define MHC_WGMMA_D72 MHC_WGMMA_D64, MHC_WGMMA_D8(64)
#define MHC_WGMMA_R12 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11"
#define MHC_WGMMA_R16 MHC_WGMMA_R12 ",%12,%13,%14,%15"
#define MHC_WGMMA_R32 \
  MHC_WGMMA_R16       \
  ",%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define MHC_WGMMA_R40                                \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,"           \
  "%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
  "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35," \
  "%36,%37,%38,%39"
#define MHC_WGMMA_R48 \
  MHC_WGMMA_R40       \
  ",%40,%41,%42,%43,%44,%45,%46,%47"
#define MHC_WGMMA_R64                                 \
  MHC_WGMMA_R48                                       \
  ",%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59," \
  "%60,%61,%62,%63"
#define MHC_WGMMA_R72 \
  MHC_WGMMA_R64       \
  ",%64,%65,%66,%67,%68,%69,%70,%71"

// d (64 x kN, fp32) += A (64 x 8 tf32) * B (8 x kN tf32), both operands
// from shared memory tiles in the swizzled layout, named by descriptors.
template <int kN>
__device__ __forceinline__ void WgmmaTf32(float (&d)[kN / 2], uint64_t a,
                                          uint64_t b);

// kA, kB, kP: the names of the descriptors and of the scale-d flag.
#define MHC_WGMMA_TF32(kN, kRegs, kOperands, kA, kB, kP)                       \
  template <>                                                                  \
  __device__ __forceinline__ void WgmmaTf32<kN>(float(&d)[kN / 2], uint64_t a, \
                                                uint64_t b) {                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " kP                        \
                 ", 0;\n"                                                      \
                 "wgmma.mma_async.sync.aligned.m64n" #kN                       \
                 "k8.f32.tf32.tf32 {" kRegs "}, " kA ", " kB ", p, 1, 1;\n}\n" \
                 : kOperands                                                   \
                 : "l"(a), "l"(b), "r"(1));                                    \
  }
MHC_WGMMA_TF32(64, MHC_WGMMA_R32, MHC_WGMMA_D32, "%32", "%33", "%34")
MHC_WGMMA_TF32(96, MHC_WGMMA_R48, MHC_WGMMA_D48, "%48", "%49", "%50")
MHC_WGMMA_TF32(128, MHC_WGMMA_R64, MHC_WGMMA_D64, "%64", "%65", "%66")
MHC_WGMMA_TF32(144, MHC_WGMMA_R72, MHC_WGMMA_D72, "%72", "%73", "%74")
#undef MHC_WGMMA_TF32

// d (64 x kN, fp32) += A (64 x 8 tf32) * B (8 x kN tf32), A from registers
// (warp w of the warpgroup: rows 16 w .. 16 w + 15 in the m16n8k8 A
// fragment layout), B from a swizzled shared-memory tile.
template <int kN>
__device__ __forceinline__ void WgmmaTf32RegA(float (&d)[kN / 2],
                                              const uint32_t (&a)[4],
                                              uint64_t b);

// kA: the names of A's four registers; kB, kP as above.
#define MHC_WGMMA_TF32_REG_A(kN, kRegs, kOperands, kA, kB, kP)                 \
  template <>                                                                  \
  __device__ __forceinline__ void WgmmaTf32RegA<kN>(                           \
      float(&d)[kN / 2], const uint32_t(&a)[4], uint64_t b) {                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " kP                        \
                 ", 0;\n"                                                      \
                 "wgmma.mma_async.sync.aligned.m64n" #kN                       \
                 "k8.f32.tf32.tf32 {" kRegs "}, " kA ", " kB ", p, 1, 1;\n}\n" \
                 : kOperands                                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b),         \
                   "r"(1));                                                    \
  }
MHC_WGMMA_TF32_REG_A(24, MHC_WGMMA_R12, MHC_WGMMA_D12, "{%12,%13,%14,%15}",
                     "%16", "%17")
MHC_WGMMA_TF32_REG_A(32, MHC_WGMMA_R16, MHC_WGMMA_D16, "{%16,%17,%18,%19}",
                     "%20", "%21")
MHC_WGMMA_TF32_REG_A(80, MHC_WGMMA_R40, MHC_WGMMA_D40, "{%40,%41,%42,%43}",
                     "%44", "%45")
MHC_WGMMA_TF32_REG_A(96, MHC_WGMMA_R48, MHC_WGMMA_D48, "{%48,%49,%50,%51}",
                     "%52", "%53")
MHC_WGMMA_TF32_REG_A(144, MHC_WGMMA_R72, MHC_WGMMA_D72, "{%72,%73,%74,%75}",
                     "%76", "%77")
#undef MHC_WGMMA_TF32_REG_A

// d (64 x kN, fp32) += A (64 x 16 bf16) * B (16 x kN bf16), both operands
// from swizzled shared-memory tiles (K-major: no transpose).
template <int kN>
__device__ __forceinline__ void WgmmaBf16(float (&d)[kN / 2], uint64_t a,
                                          uint64_t b);

#define MHC_WGMMA_BF16(kN, kRegs, kOperands, kA, kB, kP)                       \
  template <>                                                                  \
  __device__ __forceinline__ void WgmmaBf16<kN>(float(&d)[kN / 2], uint64_t a, \
                                                uint64_t b) {                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " kP                        \
                 ", 0;\n"                                                      \
                 "wgmma.mma_async.sync.aligned.m64n" #kN                       \
                 "k16.f32.bf16.bf16 {" kRegs "}, " kA ", " kB                  \
                 ", p, 1, 1, 0, 0;\n}\n"                                       \
                 : kOperands                                                   \
                 : "l"(a), "l"(b), "r"(1));                                    \
  }
MHC_WGMMA_BF16(24, MHC_WGMMA_R12, MHC_WGMMA_D12, "%12", "%13", "%14")
MHC_WGMMA_BF16(80, MHC_WGMMA_R40, MHC_WGMMA_D40, "%40", "%41", "%42")
#undef MHC_WGMMA_BF16

// d (64 x kN, fp32) += A (64 x 16 bf16) * B (16 x kN bf16), A from registers
// (warp w of the warpgroup: rows 16 w .. 16 w + 15 in the m16n8k16 A
// fragment layout), B from a swizzled shared-memory tile.
template <int kN>
__device__ __forceinline__ void WgmmaBf16RegA(float (&d)[kN / 2],
                                              const uint32_t (&a)[4],
                                              uint64_t b);

#define MHC_WGMMA_BF16_REG_A(kN, kRegs, kOperands, kA, kB, kP)              \
  template <>                                                               \
  __device__ __forceinline__ void WgmmaBf16RegA<kN>(                        \
      float(&d)[kN / 2], const uint32_t(&a)[4], uint64_t b) {               \
    asm volatile(                                                           \
        "{\n.reg .pred p;\nsetp.ne.b32 p, " kP                              \
        ", 0;\n"                                                            \
        "wgmma.mma_async.sync.aligned.m64n" #kN "k16.f32.bf16.bf16 {" kRegs \
        "}, " kA ", " kB ", p, 1, 1, 0;\n}\n"                               \
        : kOperands                                                         \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));      \
  }
MHC_WGMMA_BF16_REG_A(24, MHC_WGMMA_R12, MHC_WGMMA_D12, "{%12,%13,%14,%15}",
                     "%16", "%17")
#undef MHC_WGMMA_BF16_REG_A

#undef MHC_WGMMA_D8
#undef MHC_WGMMA_D12
#undef MHC_WGMMA_D16
#undef MHC_WGMMA_D32
#undef MHC_WGMMA_D40
#undef MHC_WGMMA_D48
#undef MHC_WGMMA_D64
#undef MHC_WGMMA_D72
#undef MHC_WGMMA_R12
#undef MHC_WGMMA_R16
#undef MHC_WGMMA_R32
#undef MHC_WGMMA_R40
#undef MHC_WGMMA_R48
#undef MHC_WGMMA_R64
#undef MHC_WGMMA_R72

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PRIMITIVES_WGMMA_CUH_
