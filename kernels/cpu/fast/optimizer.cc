// Fast CPU optimizer step (mhc/ops/optimizer.h). Work is split into the
// kNormChunk chunks of every block, numbered in (block, chunk) order; each
// task takes a contiguous range of chunk numbers. A chunk's norm partial is
// a float64 sum in element order written to its own slot, and the slots are
// summed in order by one thread, so the bits never depend on the threads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/optimizer_update.h"
#include "cpu/fast/cpu_ops.h"

namespace mhc::cpu {
namespace {

// Calls fn(tensor, first, count, chunk_number) for the chunks numbered
// [begin, end): `first` and `count` are the chunk's elements in the block.
template <typename F>
void ForChunks(const OptimizerStepParams& p, int64_t begin, int64_t end,
               F&& fn) {
  int64_t number = 0;
  for (int64_t i = 0; i < p.num_tensors && number < end; ++i) {
    const OptimizerTensor& t = p.tensors[i];
    const int64_t chunks = (t.count + kNormChunk - 1) / kNormChunk;
    if (number + chunks <= begin) {
      number += chunks;
      continue;
    }
    for (int64_t c = std::max<int64_t>(0, begin - number);
         c < chunks && number + c < end; ++c) {
      const int64_t first = c * kNormChunk;
      fn(t, first, std::min(kNormChunk, t.count - first), number + c);
    }
    number += chunks;
  }
}

// Runs fn over every chunk on the pool, a few contiguous ranges per thread.
template <typename F>
void ParallelChunks(ThreadPool& pool, const OptimizerStepParams& p,
                    int64_t chunks, F&& fn) {
  const int64_t target = 4 * static_cast<int64_t>(pool.threads());
  const int64_t per_task = std::max<int64_t>(1, (chunks + target - 1) / target);
  pool.Run((chunks + per_task - 1) / per_task, [&](int64_t task, int) {
    ForChunks(p, task * per_task, std::min(chunks, (task + 1) * per_task), fn);
  });
}

double ChunkSquares(const float* g, int64_t count) {
  double sum = 0.0;
  for (int64_t e = 0; e < count; ++e) {
    const double x = g[e];
    sum += x * x;
  }
  return sum;
}

}  // namespace

absl::Status OptimizerStep(ThreadPool& pool, const OptimizerStepParams& p,
                           Workspace ws) {
  const int64_t chunks = NormPartialCount(p);
  float clip_scale = 1.0f;
  if (NeedsGradNorm(p)) {
    double* partials = reinterpret_cast<double*>(static_cast<char*>(ws.data) +
                                                 kOptimizerScalarBytes);
    ParallelChunks(pool, p, chunks,
                   [&](const OptimizerTensor& t, int64_t first, int64_t count,
                       int64_t number) {
                     partials[number] = ChunkSquares(t.grads + first, count);
                   });
    double sum = 0.0;
    for (int64_t c = 0; c < chunks; ++c) sum += partials[c];
    const double norm = std::sqrt(sum);
    if (p.grad_norm != nullptr) *p.grad_norm = norm;
    clip_scale = ClipScale(norm, p.hyper.max_grad_norm);
  }
  const bool adamw = p.hyper.algorithm == OptimizerAlgorithm::kAdamW;
  ParallelChunks(
      pool, p, chunks,
      [&](const OptimizerTensor& t, int64_t first, int64_t count, int64_t) {
        // A few scalar float64 operations per chunk; the update dominates.
        const OptimizerCoefficients c =
            MakeOptimizerCoefficients(p.hyper, t.step);
        float* values = t.values + first;
        float* grads = t.grads + first;
        float* slot0 = t.slots + first;
        if (adamw) {
          float* slot1 = t.slots + t.count + first;
          for (int64_t e = 0; e < count; ++e) {
            AdamWElement(c, clip_scale, grads[e], &values[e], &slot0[e],
                         &slot1[e]);
          }
        } else {
          for (int64_t e = 0; e < count; ++e) {
            SgdElement(c, clip_scale, grads[e], &values[e], &slot0[e]);
          }
        }
        if (p.zero_grads) {
          std::memset(grads, 0, static_cast<size_t>(count) * sizeof(float));
        }
      });
  return absl::OkStatus();
}

}  // namespace mhc::cpu
