// See vec.h. The arithmetic loops use GCC/Clang function multiversioning
// (target_clones): an x86-64-v3 clone and a baseline clone behind one ifunc,
// resolved once per process. Conversions dispatch on a flag computed once.
#include "cpu/fast/vec.h"

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "mhc/dtype.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MHC_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define MHC_CLONES
#endif
#define MHC_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace mhc::cpu {
namespace {

bool DetectAvx2() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  // F16C from CPUID leaf 1 (ECX): clang before 15 has no "f16c" for
  // __builtin_cpu_supports, and the fuzz build compiles with clang 14.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         f16c;
#else
  return false;
#endif
}

// Function-local so that a call from another translation unit's static
// initialiser still sees the detected value, never a zero-initialised one.
bool HasAvx2() {
  static const bool has_avx2 = DetectAvx2();
  return has_avx2;
}

MHC_AVX2 void LoadBf16Avx2(const uint16_t* in, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(w));
  }
  for (; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
}

// Eight floats rounded to bf16 exactly as FloatToBf16 does.
MHC_AVX2 inline __m128i PackBf16(__m256 value) {
  const __m256i w = _mm256_castps_si256(value);
  const __m256i is_nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7fffffff)),
                         _mm256_set1_epi32(0x7f800000));
  const __m256i high = _mm256_srli_epi32(w, 16);
  const __m256i rounding = _mm256_add_epi32(
      _mm256_set1_epi32(0x7fff), _mm256_and_si256(high, _mm256_set1_epi32(1)));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(w, rounding), 16);
  const __m256i nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  const __m256i bits = _mm256_blendv_epi8(rounded, nan, is_nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(bits),
                          _mm256_extracti128_si256(bits, 1));
}

MHC_AVX2 inline __m256 LoadBf16x8(const uint16_t* in) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Converts n floats to bf16; `stream` uses non-temporal stores, which needs
// `out` 16-byte aligned.
MHC_AVX2 void Bf16RangeAvx2(const float* in, int64_t n, uint16_t* out,
                            bool stream) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i packed = PackBf16(_mm256_loadu_ps(in + i));
    if (stream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), packed);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), packed);
    }
  }
  for (; i < n; ++i) out[i] = FloatToBf16(in[i]);  // same bits as the vector
}

// [begin, end) of the elements of `out` that fill whole 64-byte lines:
// only those are streamed, so no line mixes streaming and regular stores
// (which happens at the joins of neighbouring blocks otherwise).
void WholeLines(const void* out, int64_t n, size_t size, int64_t* begin,
                int64_t* end) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(out);
  const uintptr_t first = (address + 63) & ~uintptr_t{63};
  *begin = std::min<int64_t>(n, static_cast<int64_t>((first - address) / size));
  const int64_t per_line = static_cast<int64_t>(64 / size);
  *end = *begin + (n - *begin) / per_line * per_line;
}

MHC_AVX2 void StoreBf16Avx2(const float* in, int64_t n, uint16_t* out,
                            bool stream) {
  if (!stream) return Bf16RangeAvx2(in, n, out, false);
  int64_t begin, end;
  WholeLines(out, n, sizeof(uint16_t), &begin, &end);
  Bf16RangeAvx2(in, begin, out, false);
  Bf16RangeAvx2(in + begin, end - begin, out + begin, true);
  Bf16RangeAvx2(in + end, n - end, out + end, false);
}

MHC_AVX2 void LoadHalfAvx2(const uint16_t* in, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

// The scalar tail uses the same instruction as the vector body so that NaN
// payloads, too, never depend on an element's position.
MHC_AVX2 uint16_t FloatToHalfF16c(float value) {
  const __m128i h = _mm_cvtps_ph(_mm_set_ss(value),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return static_cast<uint16_t>(_mm_cvtsi128_si32(h) & 0xffff);
}

MHC_AVX2 void HalfRangeAvx2(const float* in, int64_t n, uint16_t* out,
                            bool stream) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (stream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), h);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
    }
  }
  for (; i < n; ++i) out[i] = FloatToHalfF16c(in[i]);
}

MHC_AVX2 void StoreHalfAvx2(const float* in, int64_t n, uint16_t* out,
                            bool stream) {
  if (!stream) return HalfRangeAvx2(in, n, out, false);
  int64_t begin, end;
  WholeLines(out, n, sizeof(uint16_t), &begin, &end);
  HalfRangeAvx2(in, begin, out, false);
  HalfRangeAvx2(in + begin, end - begin, out + begin, true);
  HalfRangeAvx2(in + end, n - end, out + end, false);
}

MHC_AVX2 void StreamF32Avx2(const float* in, int64_t n, float* out) {
  int64_t begin, end;
  WholeLines(out, n, sizeof(float), &begin, &end);
  std::memcpy(out, in, begin * sizeof(float));
  for (int64_t i = begin; i < end; i += 8) {
    _mm256_stream_ps(out + i, _mm256_loadu_ps(in + i));
  }
  std::memcpy(out + end, in + end, (n - end) * sizeof(float));
}

// Lane tree shared by BlockDot and BlockDot4.
inline float ReduceLanes(float* lanes) {
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

}  // namespace

bool UsingAvx2() { return HasAvx2(); }

void FenceStreams() { _mm_sfence(); }

void LoadAct(DType dtype, const void* base, int64_t index, int64_t count,
             float* out) {
  if (dtype == DType::kF32) {
    std::memcpy(out, static_cast<const float*>(base) + index,
                static_cast<size_t>(count) * sizeof(float));
    return;
  }
  const uint16_t* in = static_cast<const uint16_t*>(base) + index;
  if (dtype == DType::kBF16) {
    if (HasAvx2()) return LoadBf16Avx2(in, count, out);
    for (int64_t i = 0; i < count; ++i) out[i] = Bf16ToFloat(in[i]);
  } else {
    if (HasAvx2()) return LoadHalfAvx2(in, count, out);
    for (int64_t i = 0; i < count; ++i) out[i] = HalfToFloat(in[i]);
  }
}

void StoreAct(DType dtype, const float* in, int64_t count, void* base,
              int64_t index, bool stream) {
  stream = stream && HasAvx2();
  if (dtype == DType::kF32) {
    if (stream) {
      return StreamF32Avx2(in, count, static_cast<float*>(base) + index);
    }
    std::memcpy(static_cast<float*>(base) + index, in,
                static_cast<size_t>(count) * sizeof(float));
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(base) + index;
  if (dtype == DType::kBF16) {
    if (HasAvx2()) return StoreBf16Avx2(in, count, out, stream);
    for (int64_t i = 0; i < count; ++i) out[i] = FloatToBf16(in[i]);
  } else {
    if (HasAvx2()) return StoreHalfAvx2(in, count, out, stream);
    for (int64_t i = 0; i < count; ++i) out[i] = FloatToHalf(in[i]);
  }
}

MHC_CLONES void Scale(float a, const float* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = a * x[i];
}

MHC_CLONES void Axpy(float a, const float* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] += a * x[i];
}

MHC_CLONES void AddTo(const float* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] += x[i];
}

MHC_CLONES void Multiply(const float* a, const float* b, int64_t n,
                         float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] * b[i];
}

namespace {

// The compiler vectorises this loop nest poorly, so the AVX2 path is
// written out; both paths use one rounding per term (FMA on AVX2, mul + add
// on the baseline) in the body and in the tail alike.
MHC_AVX2 void CombineAvx2(const float* coef, const float* const* src, int count,
                          int64_t n, bool accumulate, float* out) {
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    if (accumulate) {
      a0 = _mm256_loadu_ps(out + c);
      a1 = _mm256_loadu_ps(out + c + 8);
      a2 = _mm256_loadu_ps(out + c + 16);
      a3 = _mm256_loadu_ps(out + c + 24);
    }
    for (int s = 0; s < count; ++s) {
      const __m256 k = _mm256_set1_ps(coef[s]);
      const float* x = src[s] + c;
      a0 = _mm256_fmadd_ps(k, _mm256_loadu_ps(x), a0);
      a1 = _mm256_fmadd_ps(k, _mm256_loadu_ps(x + 8), a1);
      a2 = _mm256_fmadd_ps(k, _mm256_loadu_ps(x + 16), a2);
      a3 = _mm256_fmadd_ps(k, _mm256_loadu_ps(x + 24), a3);
    }
    _mm256_storeu_ps(out + c, a0);
    _mm256_storeu_ps(out + c + 8, a1);
    _mm256_storeu_ps(out + c + 16, a2);
    _mm256_storeu_ps(out + c + 24, a3);
  }
  for (; c + 8 <= n; c += 8) {
    __m256 a0 = accumulate ? _mm256_loadu_ps(out + c) : _mm256_setzero_ps();
    for (int s = 0; s < count; ++s) {
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(coef[s]), _mm256_loadu_ps(src[s] + c),
                           a0);
    }
    _mm256_storeu_ps(out + c, a0);
  }
  for (; c < n; ++c) {
    __m128 acc = _mm_set_ss(accumulate ? out[c] : 0.0f);
    for (int s = 0; s < count; ++s) {
      acc = _mm_fmadd_ss(_mm_set_ss(coef[s]), _mm_set_ss(src[s][c]), acc);
    }
    out[c] = _mm_cvtss_f32(acc);
  }
}

void CombineGeneric(const float* coef, const float* const* src, int count,
                    int64_t n, bool accumulate, float* out) {
  for (int64_t c = 0; c < n; ++c) {
    float acc = accumulate ? out[c] : 0.0f;
    for (int s = 0; s < count; ++s) {
      const float term = coef[s] * src[s][c];
      acc += term;
    }
    out[c] = acc;
  }
}

}  // namespace

namespace {

// Combine on bf16 rows with the conversions fused in: the same FMA sequence
// as LoadAct + CombineAvx2 + StoreAct, hence the same bits, without staging
// the rows in fp32.
MHC_AVX2 void CombineBf16Range(const float* coef, const float* first,
                               const uint16_t* const* src, int count,
                               int64_t lo, int64_t hi, uint16_t* out,
                               bool stream) {
  const int offset = first != nullptr ? 1 : 0;
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    __m256 acc = _mm256_setzero_ps();
    if (first != nullptr) {
      acc = _mm256_fmadd_ps(_mm256_set1_ps(coef[0]), _mm256_loadu_ps(first + i),
                            acc);
    }
    for (int s = 0; s < count; ++s) {
      acc = _mm256_fmadd_ps(_mm256_set1_ps(coef[s + offset]),
                            LoadBf16x8(src[s] + i), acc);
    }
    const __m128i packed = PackBf16(acc);
    if (stream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), packed);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), packed);
    }
  }
  for (; i < hi; ++i) {
    __m128 acc = _mm_setzero_ps();
    if (first != nullptr) {
      acc = _mm_fmadd_ss(_mm_set_ss(coef[0]), _mm_set_ss(first[i]), acc);
    }
    for (int s = 0; s < count; ++s) {
      acc = _mm_fmadd_ss(_mm_set_ss(coef[s + offset]),
                         _mm_set_ss(Bf16ToFloat(src[s][i])), acc);
    }
    out[i] = FloatToBf16(_mm_cvtss_f32(acc));
  }
}

}  // namespace

namespace {

MHC_AVX2 void PostBf16Avx2(const float* fb, const uint16_t* const* x,
                           const float* coef, int n, int64_t cb,
                           uint16_t* const* out, bool stream) {
  int64_t begin[kMaxStreams], end[kMaxStreams];
  for (int j = 0; j < n; ++j) {
    begin[j] = end[j] = 0;
    if (stream && reinterpret_cast<uintptr_t>(out[j]) % 16 == 0) {
      WholeLines(out[j], cb, sizeof(uint16_t), &begin[j], &end[j]);
    }
  }
  __m256 xv[kMaxStreams];
  int64_t c = 0;
  for (; c + 8 <= cb; c += 8) {
    for (int i = 0; i < n; ++i) xv[i] = LoadBf16x8(x[i] + c);
    const __m256 f = _mm256_loadu_ps(fb + c);
    for (int j = 0; j < n; ++j) {
      const float* k = coef + j * (n + 1);
      __m256 acc =
          _mm256_fmadd_ps(_mm256_set1_ps(k[0]), f, _mm256_setzero_ps());
      for (int i = 0; i < n; ++i) {
        acc = _mm256_fmadd_ps(_mm256_set1_ps(k[i + 1]), xv[i], acc);
      }
      const __m128i packed = PackBf16(acc);
      __m128i* dst = reinterpret_cast<__m128i*>(out[j] + c);
      if (c >= begin[j] && c + 8 <= end[j]) {
        _mm_stream_si128(dst, packed);
      } else {
        _mm_storeu_si128(dst, packed);
      }
    }
  }
  for (; c < cb; ++c) {
    for (int j = 0; j < n; ++j) {
      const float* k = coef + j * (n + 1);
      __m128 acc =
          _mm_fmadd_ss(_mm_set_ss(k[0]), _mm_set_ss(fb[c]), _mm_setzero_ps());
      for (int i = 0; i < n; ++i) {
        acc = _mm_fmadd_ss(_mm_set_ss(k[i + 1]),
                           _mm_set_ss(Bf16ToFloat(x[i][c])), acc);
      }
      out[j][c] = FloatToBf16(_mm_cvtss_f32(acc));
    }
  }
}

}  // namespace

bool PostCombineBf16(const float* fb, const uint16_t* const* x,
                     const float* coef, int n, int64_t cb, uint16_t* const* out,
                     bool stream) {
  if (!HasAvx2()) return false;
  PostBf16Avx2(fb, x, coef, n, cb, out, stream);
  return true;
}

bool CombineBf16(const float* coef, const float* first,
                 const uint16_t* const* src, int count, int64_t n,
                 uint16_t* out, bool stream) {
  if (!HasAvx2()) return false;
  if (!stream) {
    CombineBf16Range(coef, first, src, count, 0, n, out, false);
    return true;
  }
  int64_t begin, end;
  WholeLines(out, n, sizeof(uint16_t), &begin, &end);
  CombineBf16Range(coef, first, src, count, 0, begin, out, false);
  CombineBf16Range(coef, first, src, count, begin, end, out, true);
  CombineBf16Range(coef, first, src, count, end, n, out, false);
  return true;
}

void Combine(const float* coef, const float* const* src, int count, int64_t n,
             bool accumulate, float* out) {
  if (HasAvx2()) return CombineAvx2(coef, src, count, n, accumulate, out);
  CombineGeneric(coef, src, count, n, accumulate, out);
}

MHC_CLONES float BlockDot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) lanes[l] += a[i] * b[i];
  return ReduceLanes(lanes);
}

MHC_CLONES void BlockDot4(const float* const* a, const float* b, int64_t n,
                          float* out) {
  float l0[kLanes] = {}, l1[kLanes] = {}, l2[kLanes] = {}, l3[kLanes] = {};
  const float* a0 = a[0];
  const float* a1 = a[1];
  const float* a2 = a[2];
  const float* a3 = a[3];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = b[i + l];
      l0[l] += a0[i + l] * v;
      l1[l] += a1[i + l] * v;
      l2[l] += a2[i + l] * v;
      l3[l] += a3[i + l] * v;
    }
  }
  for (int l = 0; i < n; ++i, ++l) {
    l0[l] += a0[i] * b[i];
    l1[l] += a1[i] * b[i];
    l2[l] += a2[i] * b[i];
    l3[l] += a3[i] * b[i];
  }
  out[0] = ReduceLanes(l0);
  out[1] = ReduceLanes(l1);
  out[2] = ReduceLanes(l2);
  out[3] = ReduceLanes(l3);
}

void MultiDot(const float* const* a, int rows, const float* b, int64_t n,
              float* out) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) BlockDot4(a + r, b, n, out + r);
  for (; r < rows; ++r) out[r] = BlockDot(a[r], b, n);
}

MHC_CLONES void Deinterleave(const float* in, int streams, int64_t count,
                             float* out) {
  for (int64_t c = 0; c < count; ++c) {
    for (int i = 0; i < streams; ++i) out[i * count + c] = in[c * streams + i];
  }
}

MHC_CLONES void Interleave(const float* in, int streams, int64_t count,
                           float* out) {
  for (int64_t c = 0; c < count; ++c) {
    for (int i = 0; i < streams; ++i) out[c * streams + i] = in[i * count + c];
  }
}

}  // namespace mhc::cpu
