#include "cpu/fast/thread_pool.h"

#include <algorithm>

namespace mhc::cpu {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) {
    threads = static_cast<int>(std::thread::hardware_concurrency());
  }
  threads_ = std::max(1, threads);
  workers_.reserve(threads_ - 1);
  for (int t = 1; t < threads_; ++t) {
    workers_.emplace_back([this, t] { WorkerLoop(t); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void ThreadPool::Drain(int thread) {
  for (;;) {
    int64_t task = next_.fetch_add(1, std::memory_order_relaxed);
    if (task >= tasks_) return;
    fn_(ctx_, task, thread);
  }
}

void ThreadPool::RunImpl(int64_t tasks, TaskFn fn, void* ctx) {
  if (tasks <= 0) return;
  if (threads_ == 1 || tasks == 1) {
    for (int64_t task = 0; task < tasks; ++task) fn(ctx, task, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = fn;
    ctx_ = ctx;
    tasks_ = tasks;
    next_.store(0, std::memory_order_relaxed);
    busy_workers_ = threads_ - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  Drain(0);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return busy_workers_ == 0; });
}

void ThreadPool::WorkerLoop(int thread) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    Drain(thread);
    std::lock_guard<std::mutex> lock(mu_);
    if (--busy_workers_ == 0) done_cv_.notify_one();
  }
}

}  // namespace mhc::cpu
