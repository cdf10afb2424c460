// Shared pieces of kvjax's CPU attention kernels (XLA FFI custom calls).
//
// Vectors are GCC/Clang vector extensions of 16 floats: on an AVX-512 machine one
// zmm register, elsewhere the compiler splits them into the target's vectors, so the
// same source builds everywhere `-march=native` points. Loads go through the
// unaligned, may_alias types below because page rows are only 4-byte aligned.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // AVX-512 paths, and F16C's converts on AVX2-only CPUs
#endif

namespace kvjax {

namespace ffi = xla::ffi;

// IEEE half precision as a C++ type: GCC's C++ front end has _Float16 on x86 (SSE2 and
// later); on ARM its half type is __fp16 (storage and conversions, which is all the
// kernels use).
#if defined(__aarch64__) || defined(__arm__)
using Half = __fp16;
#else
using Half = _Float16;
#endif

constexpr int kLanes = 16;
// v16 vectors a register-blocked loop keeps live: a v16 is one of AVX-512's 32 zmm
// registers but two of AVX2's 16 ymm registers (the AVX-512 blocking spilled there: the
// KIVI and MLA kernels ran at 0.7-0.8x of the XLA path on an AVX2-only CPU).
#ifdef __AVX512F__
constexpr int kAccVecs = 16;
#else
constexpr int kAccVecs = 4;
#endif
constexpr int64_t kMaxGroup = 256;  // query rows per work item (per-row state on the stack)
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A broadcast (v16{} + x would add +0.0, which compilers must keep: -0.0 + 0.0 is +0.0).
inline v16 splat(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// Software prefetch of the line holding p into all cache levels (L1: Level 0) or L2 and
// below (Level 1). Inline asm, not __builtin_prefetch: GCC treats the builtin as free of
// side effects, so a helper made of nothing but prefetches is "const" to its IPA passes
// and its calls are deleted (every prefetch of the KIVI and MLA kernels was
// gone at -O3).
template <int Level = 0>
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (Level == 0) {
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  } else {
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
  }
#else
  __builtin_prefetch(p, 0, Level == 0 ? 3 : 2);
  asm volatile("" : : "r"(p));  // keeps the call (see above)
#endif
}

// Comparisons and selects of v16. GCC 12 lowers a comparison or a `?:` of 64-byte vectors
// on a 32-byte target (AVX2) lane by lane: scalar compares and blends through the stack
// (measured on AVX2 code: vexp 9x, a select 5x slower than two 8-float halves). There
// they run on the two halves, which the compiler keeps in two ymm registers.
#if defined(__AVX__) && !defined(__AVX512F__)
typedef float v8h __attribute__((vector_size(32)));
typedef int32_t v8hi __attribute__((vector_size(32)));
struct Halves {
  v8h lo, hi;
};
struct HalvesI {
  v8hi lo, hi;
};
inline Halves halves(v16 x) {
  Halves h;
  __builtin_memcpy(&h, &x, sizeof(x));
  return h;
}
inline HalvesI halves(v16i x) {
  HalvesI h;
  __builtin_memcpy(&h, &x, sizeof(x));
  return h;
}
inline v16 join(v8h lo, v8h hi) {
  Halves h{lo, hi};
  v16 x;
  __builtin_memcpy(&x, &h, sizeof(x));
  return x;
}
inline v16i join(v8hi lo, v8hi hi) {
  HalvesI h{lo, hi};
  v16i x;
  __builtin_memcpy(&x, &h, sizeof(x));
  return x;
}
inline v16i lt(v16 a, v16 b) {
  const Halves x = halves(a), y = halves(b);
  return join(x.lo < y.lo, x.hi < y.hi);
}
inline v16 select(v16i m, v16 a, v16 b) {
  const HalvesI k = halves(m);
  const Halves x = halves(a), y = halves(b);
  return join(k.lo ? x.lo : y.lo, k.hi ? x.hi : y.hi);
}
#else
inline v16i lt(v16 a, v16 b) { return a < b; }
inline v16 select(v16i m, v16 a, v16 b) { return m ? a : b; }
#endif
inline v16 load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store16(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }
inline v16i gt(v16 a, v16 b) { return lt(b, a); }
inline v16i ge(v16 a, v16 b) { return ~lt(a, b); }  // not for NaN operands
inline v16 vmax(v16 a, v16 b) { return select(gt(a, b), a, b); }
inline v16 vmin(v16 a, v16 b) { return select(lt(a, b), a, b); }
inline v16 vabs(v16 x) {
  const v16i bits = reinterpret_cast<v16i&>(x) & 0x7fffffff;
  return reinterpret_cast<const v16&>(bits);
}

// Whether any lane of a comparison result (lanes 0 or -1) is true.
inline bool any(v16i x) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask(reinterpret_cast<__m512i>(x), reinterpret_cast<__m512i>(x)) != 0;
#elif defined(__AVX__)
  const HalvesI h = halves(x);
  const __m256i o = reinterpret_cast<__m256i>(h.lo | h.hi);
  return !_mm256_testz_si256(o, o);
#else
  int32_t r = 0;
  for (int i = 0; i < kLanes; ++i) r |= x[i];
  return r != 0;
#endif
}

inline float hmax(v16 x) {
#if defined(__AVX__) && !defined(__AVX512F__)
  const Halves h = halves(x);
  v8h y = h.lo > h.hi ? h.lo : h.hi;
  v8h z = __builtin_shufflevector(y, y, 4, 5, 6, 7, 0, 1, 2, 3);
  y = y > z ? y : z;
  z = __builtin_shufflevector(y, y, 2, 3, 0, 1, 6, 7, 4, 5);
  y = y > z ? y : z;
  z = __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6);
  y = y > z ? y : z;
  return y[0];
#else
  x = vmax(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  x = vmax(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  x = vmax(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  x = vmax(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return x[0];
#endif
}

inline float hsum(v16 x) {
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return x[0];
}

// Sums of 16 vectors as one vector: lane t = sum of the lanes of a[t]. A transpose-and-add
// tree (15 steps of two shuffles and an add) instead of 16 separate horizontal sums.
// Each level halves the lanes per input; feeding the inputs in bit-reversed order makes
// the output lanes come out in natural order. V: v16 or v16i (the integer logits' sums).
template <typename V>
inline V sum_rows_16(const V* a) {
  auto l8 = [](V x, V y) {
    return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  };
  auto l4 = [](V x, V y) {
    return __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                                   31);
  };
  auto l2 = [](V x, V y) {
    return __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                   31);
  };
  auto l1 = [](V x, V y) {
    return __builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  };
  // rev4(i) for i = 0..15: 0 8 4 12 2 10 6 14 1 9 5 13 3 11 7 15.
  V b0 = l8(a[0], a[8]), b1 = l8(a[4], a[12]), b2 = l8(a[2], a[10]), b3 = l8(a[6], a[14]);
  V b4 = l8(a[1], a[9]), b5 = l8(a[5], a[13]), b6 = l8(a[3], a[11]), b7 = l8(a[7], a[15]);
  V c0 = l4(b0, b1), c1 = l4(b2, b3), c2 = l4(b4, b5), c3 = l4(b6, b7);
  V d0 = l2(c0, c1), d1 = l2(c2, c3);
  return l1(d0, d1);
}

#if defined(__AVX__) && !defined(__AVX512F__)
// The same on AVX2 over 8-float halves: each input's halves added, then an 8-lane tree per
// half of the result. GCC lowers the 16-lane shuffles above element by element on a
// 32-byte target (measured 11x slower than on AVX-512; this form ~1x).
template <typename H>
inline H sum_rows_8(const H* s) {
  auto l4 = [](H x, H y) {
    return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
  };
  auto l2 = [](H x, H y) {
    return __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  };
  auto l1 = [](H x, H y) {
    return __builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
  };
  // rev3(i) for i = 0..7: 0 4 2 6 1 5 3 7.
  const H b0 = l4(s[0], s[4]), b1 = l4(s[2], s[6]), b2 = l4(s[1], s[5]), b3 = l4(s[3], s[7]);
  return l1(l2(b0, b1), l2(b2, b3));
}
inline v16 sum_rows(const v16* a) {
  v8h s[16];
  for (int t = 0; t < 16; ++t) {
    const Halves h = halves(a[t]);
    s[t] = h.lo + h.hi;
  }
  return join(sum_rows_8(s), sum_rows_8(s + 8));
}
inline v16i sum_rows(const v16i* a) {
  v8hi s[16];
  for (int t = 0; t < 16; ++t) {
    const HalvesI h = halves(a[t]);
    s[t] = h.lo + h.hi;
  }
  return join(sum_rows_8(s), sum_rows_8(s + 8));
}
#else
inline v16 sum_rows(const v16* a) { return sum_rows_16(a); }
inline v16i sum_rows(const v16i* a) { return sum_rows_16(a); }
#endif

// exp(x) for x <= 0 or moderately positive (softmax arguments), about 2 ulp: 2^n * p(r)
// with n = round(x / ln 2) and a degree-6 polynomial on |r| <= ln(2) / 2 (Cephes' expf
// coefficients). Inputs below -87.3 give 0 (exp(-inf) = 0, as the softmax needs).
inline v16 vexp(v16 x) {
  const v16 lo = splat(-87.33654f), hi = splat(88.37626f);
  const v16i tiny = lt(x, lo);
  x = vmin(vmax(x, lo), hi);
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  v16 n = (x * 1.44269504088896341f + magic) - magic;
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16 y = p * reinterpret_cast<v16&>(e);
  v16i bits = reinterpret_cast<v16i&>(y) & ~tiny;
  return reinterpret_cast<v16&>(bits);
}

inline v16 vtanh(v16 x) {
  // tanh(x) = 1 - 2 / (exp(2x) + 1); exp saturates at the clamp, giving +-1.
  return 1.0f - 2.0f / (vexp(x * 2.0f) + 1.0f);
}

// bfloat16 as its bit pattern (a distinct type, so templates can tell it from float16).
struct Bf16 {
  uint16_t bits;
};

// One float32 value of a float32, bfloat16 or float16 element.
template <typename T>
inline float to_float(T x) {
  if constexpr (std::is_same_v<T, Bf16>) {
    uint32_t u = static_cast<uint32_t>(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    return static_cast<float>(x);
  }
}

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Widens n bf16 values (bit patterns) to float32 in dst: a zero-extend and a shift per
// element, a loop the compiler vectorises.
inline void widen_bf16(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + kLanes <= n; i += kLanes) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_si512(dst + i, _mm512_slli_epi32(w, 16));
  }
#endif
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (; i < n; ++i) d[i] = static_cast<uint32_t>(src[i]) << 16;
}

// float16 to float32 (vcvtph2ps where the CPU has it).
inline void widen_f16(const Half* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + kLanes <= n; i += kLanes)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(src + i))));
#endif
#ifdef __F16C__
  // Short rows (a KIVI value row's few group scales) too: scalar converts merge into their
  // destination register, a dependency chain from one element to the next.
  for (; i + 4 <= n; i += 4)
    _mm_storeu_ps(dst + i, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline int64_t clamp_index(int64_t i, int64_t n) { return i < 0 ? 0 : (i >= n ? n - 1 : i); }

// Process-wide thread settings, set by the one configuration call `KvjaxConfigure`
// (config.cc; the Python options push them at load and on every change). The C++ code
// reads no environment variable: per-call settings come as custom-call attributes.
struct ThreadConfig {
  std::atomic<int64_t> threads{0};    // workers per call, the caller included (0: one per core)
  std::atomic<int64_t> pool{0};       // 0: own helper pool, 1: XLA's intra-op pool, 2: std::thread
  std::atomic<int64_t> spin_us{200};  // idle spin before parking (0: park at once)
};
inline ThreadConfig& thread_config() {
  static ThreadConfig config;
  return config;
}

// How long (microseconds) an idle helper thread, and a caller waiting for the last items,
// spin before parking on a condition variable. A decode step makes dozens of short calls
// (a layer's matmuls take 0.05-0.2 ms each at batch 1): waking a parked thread cost ~30 us
// a call on a 2-core VM.
inline int64_t spin_us() { return thread_config().spin_us.load(std::memory_order_relaxed); }

// Per-call settings of the attention kernels (custom-call attributes; CpuOptions.tuning).
struct Tuning {
  int64_t prefetch = 1;  // 16-token chunks prefetched ahead (0: none)
  int64_t touch = 4;     // chunks ahead whose pages are touched early (0: none)
  bool rows = true;      // rows / codes read in place by attend_rows (false: staged)
  int64_t share = 0;     // decode: shared pages read once from this many tokens (0: never)
  bool int_logits = true;
  bool int_values = true;
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins until pred() or spin_us() have passed; returns pred().
template <typename Pred>
inline bool spin_until(Pred&& pred) {
  if (pred()) return true;
  const int64_t us = spin_us();
  if (us <= 0) return false;
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (;;) {
    for (int k = 0; k < 64; ++k) {
      if (pred()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= end) return pred();
  }
}

// Runs fn(i, worker) for i in [0, total) on the caller and helper threads that draw
// items from one atomic counter. Helpers come from, per the configured pool:
//   0 "own" (default): a persistent pool of hardware_concurrency - 1 threads owned by this
//     library (started on first use, parked on a condition variable between calls);
//   1 "xla": XLA's intra-op thread pool (the FFI ThreadPool context). Measured: XLA often
//     runs the custom call itself on that pool's thread, and the helper task then queues
//     behind it, so the call ran single-threaded in about half of the calls;
//   2 "std": fresh std::threads per call.
// The configured thread count (0: one per core) caps the workers, the caller included.
// The caller waits for items, not for helpers: a helper that starts after the last item
// finds none and touches only the shared state, which it co-owns.
struct WorkState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
  std::function<void(int64_t, int)> fn;  // (item, worker id)
  std::mutex mu;
  std::condition_variable cv;

  void run(int worker) {
    int64_t i;
    while ((i = next.fetch_add(1)) < total) {
      fn(i, worker);
      if (done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

// The library's own helper threads. Never destroyed (a static destructor joining threads
// at process exit could hang), so the threads are detached.
class HelperPool {
 public:
  static HelperPool& get() {
    static HelperPool* pool = new HelperPool();
    return *pool;
  }
  int size() const { return static_cast<int>(n_); }
  void schedule(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
      pending_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_one();
  }

 private:
  HelperPool() {
    int64_t hw = std::thread::hardware_concurrency();
    n_ = hw > 1 ? hw - 1 : 0;
    for (int64_t i = 0; i < n_; ++i) std::thread([this] { loop(); }).detach();
  }
  void loop() {
    for (;;) {
      // The next call usually comes within microseconds: spin a while before parking.
      spin_until([this] { return pending_.load(std::memory_order_acquire) > 0; });
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !tasks_.empty(); });
        task = std::move(tasks_.front());
        tasks_.erase(tasks_.begin());
        pending_.fetch_sub(1, std::memory_order_relaxed);
      }
      task();
    }
  }
  int64_t n_ = 0;
  std::atomic<int64_t> pending_{0};  // tasks queued (read without the lock by spinners)
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::function<void()>> tasks_;
};

// The workers parallel_for would use for an unbounded number of items (the caller
// included).
inline int64_t parallel_workers(ffi::ThreadPool* pool) {
  const int64_t mode = thread_config().pool.load(std::memory_order_relaxed);
  const int64_t cap = thread_config().threads.load(std::memory_order_relaxed);
  int64_t hw = std::thread::hardware_concurrency();
  hw = hw > 0 ? hw : 1;
  int64_t workers = 1;
  if (mode == 0) {
    workers = HelperPool::get().size() + 1;
  } else if (mode == 1) {
    int64_t p = pool ? pool->num_threads() : 0;
    workers = p > 0 ? std::min(p + 1, hw) : 1;
  } else {
    workers = hw;
  }
  return cap > 0 ? std::min(workers, cap) : workers;
}

inline void parallel_for(ffi::ThreadPool* pool, int64_t total,
                         std::function<void(int64_t, int)> fn) {
  if (total <= 0) return;
  const int64_t mode = thread_config().pool.load(std::memory_order_relaxed);
  const int64_t workers = std::min(parallel_workers(pool), total);
  if (workers <= 1) {
    for (int64_t i = 0; i < total; ++i) fn(i, 0);
    return;
  }
  auto state = std::make_shared<WorkState>();
  state->total = total;
  state->fn = std::move(fn);
  std::vector<std::thread> threads;
  for (int w = 1; w < workers; ++w) {
    if (mode == 2) {
      threads.emplace_back([state, w] { state->run(w); });
    } else if (mode == 1) {
      pool->Schedule([state, w] { state->run(w); });
    } else {
      HelperPool::get().schedule([state, w] { state->run(w); });
    }
  }
  state->run(0);
  if (!spin_until([&] { return state->done.load(std::memory_order_acquire) == total; })) {
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->done.load() == total; });
  }
  for (auto& t : threads) t.join();
}

}  // namespace kvjax
