// A small persistent thread pool for the CPU backend. Threads are created
// once; Run() hands out task indices through an atomic counter and never
// allocates, so an op's hot path does no thread creation or heap allocation.
// Which thread runs which task is not deterministic; every kernel therefore
// makes its results depend only on the task index, never on the thread.
#ifndef MHC_KERNELS_CPU_FAST_THREAD_POOL_H_
#define MHC_KERNELS_CPU_FAST_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace mhc::cpu {

class ThreadPool {
 public:
  // threads <= 0: one per hardware thread. The caller's thread counts as one.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return threads_; }

  // Calls fn(task, thread) for every task in [0, tasks) and returns when all
  // are done; `thread` in [0, threads()) indexes per-thread scratch.
  template <typename F>
  void Run(int64_t tasks, F&& fn) {
    using Fn = std::remove_reference_t<F>;
    RunImpl(
        tasks,
        [](void* ctx, int64_t task, int thread) {
          (*static_cast<Fn*>(ctx))(task, thread);
        },
        const_cast<void*>(static_cast<const void*>(&fn)));
  }

 private:
  using TaskFn = void (*)(void* ctx, int64_t task, int thread);

  void RunImpl(int64_t tasks, TaskFn fn, void* ctx);
  void WorkerLoop(int thread);
  void Drain(int thread);

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;
  int busy_workers_ = 0;
  bool stop_ = false;
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t tasks_ = 0;
  std::atomic<int64_t> next_{0};
};

}  // namespace mhc::cpu

#endif  // MHC_KERNELS_CPU_FAST_THREAD_POOL_H_
