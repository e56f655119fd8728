// The thread pool the CPU kernels split their row loops over.
//
// MLX's CPU backend runs every primitive on its stream's single worker thread; the
// kernels here split their loops over a pool (the calling thread is worker 0). When
// mlxvlm loaded its BLAS shim (mlxvlm/cpu/blas_shim.c, Linux with OpenBLAS), that is the
// shim's pool, which the float32 products run on too: one set of threads, spinning
// briefly between jobs, so that neither OpenBLAS's idle threads spin next to a kernel
// nor each operation of a decoding step wakes a sleeping thread. Without the shim the
// kernels keep a pool of their own here, whose threads wait on a condition variable
// between jobs; callers only go parallel for work of more than a few tens of
// microseconds either way.
#pragma once

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mlxvlm {

class ThreadPool {
 public:
  explicit ThreadPool(int threads) : threads_(std::max(1, threads)) {
    for (int i = 1; i < threads_; i++) workers_.emplace_back([this, i] { work(i); });
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      generation_++;
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  int size() const { return threads_; }

  // body(worker, workers) on every worker; returns when all have finished. One job at
  // a time: a second caller (another MLX stream) waits for the first.
  void run(const std::function<void(int, int)>& body) {
    if (threads_ == 1) {
      body(0, 1);
      return;
    }
    std::lock_guard<std::mutex> one_job(job_mutex_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      body_ = &body;
      pending_ = threads_ - 1;
      generation_++;
    }
    wake_.notify_all();
    body(0, threads_);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    body_ = nullptr;
  }

 private:
  void work(int index) {
    uint64_t seen = 0;
    while (true) {
      const std::function<void(int, int)>* body;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (stopping_) return;
        body = body_;
      }
      (*body)(index, threads_);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex job_mutex_, mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int, int)>* body_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stopping_ = false;
};

// The kernels' own pool's size: set from Python (mlxvlm/cpu/policy.py's cpu_threads, the
// one place that reads MLXVLM_CPU_THREADS and the affinity mask) before the pool is made.
inline int& configured_threads() {
  static int threads = 0;
  return threads;
}

inline int default_threads() {
  if (configured_threads() > 0) return configured_threads();
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

// The BLAS shim's pool, found in the process (the shim is loaded with RTLD_GLOBAL); it
// serves once the shim is initialised (threads() > 0).
struct SharedPool {
  using part_fn = void (*)(const void* job, int part, int parts);
  void (*run)(part_fn, const void*) = nullptr;
  int (*threads)() = nullptr;
};

inline const SharedPool& shared_pool() {
  static const SharedPool pool = [] {
    SharedPool found;
    found.run = reinterpret_cast<void (*)(SharedPool::part_fn, const void*)>(
        dlsym(RTLD_DEFAULT, "mlxvlm_pool_run"));
    found.threads = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "mlxvlm_pool_threads"));
    if (found.run == nullptr || found.threads == nullptr) found = SharedPool{};
    return found;
  }();
  return pool;
}

inline ThreadPool& own_thread_pool() {
  // Threads do not survive fork(): a child process builds its own pool (the parent's
  // is leaked there, never joined).
  static pid_t owner = 0;
  static ThreadPool* pool = nullptr;
  static std::mutex creating;
  std::lock_guard<std::mutex> lock(creating);
  if (pool == nullptr || owner != getpid()) {
    pool = new ThreadPool(default_threads());
    owner = getpid();
  }
  return *pool;
}

// The pool the kernels use: its size, and body(worker, workers) on every worker.
class Pool {
 public:
  int size() const { return shared() ? shared_pool().threads() : own_thread_pool().size(); }

  // Whether this is the BLAS shim's pool (the float32 products' threads too).
  static bool shared() { return shared_pool().run != nullptr && shared_pool().threads() > 0; }

  void run(const std::function<void(int, int)>& body) const {
    if (!shared()) return own_thread_pool().run(body);
    shared_pool().run(
        [](const void* job, int part, int parts) {
          (*static_cast<const std::function<void(int, int)>*>(job))(part, parts);
        },
        &body);
  }
};

inline Pool thread_pool() { return Pool{}; }

// fn(start, stop) over contiguous parts of [0, n), in parallel when each worker would get
// at least `min_per_worker` items.
template <class F>
void parallel_for(int64_t n, int64_t min_per_worker, F&& fn) {
  if (n <= 0) return;
  Pool pool = thread_pool();
  int64_t workers = std::min<int64_t>(pool.size(), n / std::max<int64_t>(1, min_per_worker));
  if (workers <= 1) {
    fn(int64_t(0), n);
    return;
  }
  pool.run([&](int worker, int) {
    if (worker >= workers) return;
    int64_t start = n * worker / workers, stop = n * (worker + 1) / workers;
    if (start < stop) fn(start, stop);
  });
}

// fn(task, worker) for tasks [0, n), handed out one at a time to whichever worker is
// free: for work items of uneven cost (a causal attention's query tiles).
template <class F>
void parallel_tasks(int64_t n, F&& fn) {
  if (n <= 0) return;
  Pool pool = thread_pool();
  std::atomic<int64_t> next{0};
  auto work = [&](int worker) {
    for (int64_t task = next.fetch_add(1); task < n; task = next.fetch_add(1)) fn(task, worker);
  };
  if (n == 1 || pool.size() == 1) return work(0);
  pool.run([&](int worker, int) { work(worker); });
}

}  // namespace mlxvlm
