// Vector building blocks of the CPU backend: activation <-> fp32 conversion
// and the few loops every op is made of. Each is compiled for AVX2+FMA+F16C
// and for baseline x86-64 and picked once per process at load time, so one
// process always runs the same instructions for every token and thread.
//
// Reductions never rely on the compiler reassociating: BlockDot accumulates
// element i into lane i % kLanes and combines the lanes in a fixed tree, so a
// dot product's bits depend only on its inputs and length, never on pointer
// alignment, the token count or the thread that runs it.
#ifndef MHC_KERNELS_CPU_FAST_VEC_H_
#define MHC_KERNELS_CPU_FAST_VEC_H_

#include <cstdint>

#include "mhc/types.h"

namespace mhc::cpu {

inline constexpr int kLanes = 16;
// Channels (or k elements) per block: the fixed blocking of every per-token
// reduction (a reduction is the in-order sum of per-block BlockDots) and the
// width of the fp32 staging buffers, small enough to stay in L1/L2.
inline constexpr int64_t kBlock = 512;

// out[0, count) = activation elements [index, index + count) of `base`.
void LoadAct(DType dtype, const void* base, int64_t index, int64_t count,
             float* out);
// Rounds in[0, count) once to `dtype` into elements [index, index + count).
// `stream` uses non-temporal stores (no read-for-ownership of the output
// lines) for outputs far larger than the caches; the bits are the same.
void StoreAct(DType dtype, const float* in, int64_t count, void* base,
              int64_t index, bool stream = false);

// Orders this thread's streaming stores before its later stores; every
// parallel task calls it before it reports completion.
void FenceStreams();

// Outputs above this many bytes are written with streaming stores.
inline constexpr int64_t kStreamBytes = int64_t{32} << 20;

void Scale(float a, const float* x, int64_t n, float* out);  // out = a x
void Axpy(float a, const float* x, int64_t n, float* out);   // out += a x
void AddTo(const float* x, int64_t n, float* out);           // out += x
void Multiply(const float* a, const float* b, int64_t n, float* out);  // a*b
// out[c] (= 0 unless accumulate) then out[c] += coef[s] * src[s][c] for
// s = 0..count-1 in order: the same bits as a sequence of Axpy calls.
void Combine(const float* coef, const float* const* src, int count, int64_t n,
             bool accumulate, float* out);
// bf16 rows: out = bf16(coef[0] first + sum_s coef[s + 1] src[s]) (without
// `first`: sum_s coef[s] src[s]), bit-identical to LoadAct + Combine +
// StoreAct. Returns false (and does nothing) without AVX2.
bool CombineBf16(const float* coef, const float* first,
                 const uint16_t* const* src, int count, int64_t n,
                 uint16_t* out, bool stream);
// All n outputs of post at once on bf16 rows: out[j] = bf16(coef[j][0] fb +
// sum_i coef[j][i + 1] x[i]) with coef [n][n + 1]; each x row is converted
// once. Bit-identical to CombineBf16 per output; false without AVX2.
bool PostCombineBf16(const float* fb, const uint16_t* const* x,
                     const float* coef, int n, int64_t cb, uint16_t* const* out,
                     bool stream);
// sum_i a[i] b[i] with the fixed lane/tree order described above.
float BlockDot(const float* a, const float* b, int64_t n);
// Four BlockDots sharing b; out[r] has the same bits as BlockDot(a[r], b, n).
void BlockDot4(const float* const* a, const float* b, int64_t n, float* out);
// out[r] = BlockDot(a[r], b, n) for r < rows, four rows at a time.
void MultiDot(const float* const* a, int rows, const float* b, int64_t n,
              float* out);
// [n][count] stream-major <-> [count][n] interleaved.
void Deinterleave(const float* in, int streams, int64_t count, float* out);
void Interleave(const float* in, int streams, int64_t count, float* out);

// True when the AVX2/FMA/F16C code paths are in use.
bool UsingAvx2();

}  // namespace mhc::cpu

#endif  // MHC_KERNELS_CPU_FAST_VEC_H_
