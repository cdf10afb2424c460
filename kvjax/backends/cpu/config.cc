// The library's one configuration call and what its build targets.
//
// KvjaxConfigure sets the process-wide thread settings (common.h's ThreadConfig): the
// Python options (kvjax/backends/cpu/options.py) call it when the library is loaded and
// whenever they change. KvjaxIsa reports the instruction sets the library was compiled
// for (the -march of its build, not the CPU's), so the Python side can say which code
// paths run and choose implementations by them.

#include "common.h"

extern "C" {

// threads: workers per call, the caller included (0: one per core); pool: 0 own helper
// pool, 1 XLA's intra-op pool, 2 fresh std::threads; spin_us: idle spin before parking.
void KvjaxConfigure(int64_t threads, int64_t pool, int64_t spin_us) {
  auto& c = kvjax::thread_config();
  c.threads.store(threads < 0 ? 0 : threads, std::memory_order_relaxed);
  c.pool.store(pool < 0 || pool > 2 ? 0 : pool, std::memory_order_relaxed);
  c.spin_us.store(spin_us < 0 ? 0 : spin_us, std::memory_order_relaxed);
}

// Bits: 0 AVX2, 1 FMA, 2 F16C, 3 AVX512F, 4 AVX512BW, 5 AVX512VL, 6 AVX512VNNI,
// 7 AVX512VBMI, 8 AVX512FP16, 9 AVX512BF16, 16 aarch64 NEON, 17 aarch64 FP16 arithmetic.
int64_t KvjaxIsa() {
  int64_t bits = 0;
#ifdef __AVX2__
  bits |= 1 << 0;
#endif
#ifdef __FMA__
  bits |= 1 << 1;
#endif
#ifdef __F16C__
  bits |= 1 << 2;
#endif
#ifdef __AVX512F__
  bits |= 1 << 3;
#endif
#ifdef __AVX512BW__
  bits |= 1 << 4;
#endif
#ifdef __AVX512VL__
  bits |= 1 << 5;
#endif
#ifdef __AVX512VNNI__
  bits |= 1 << 6;
#endif
#ifdef __AVX512VBMI__
  bits |= 1 << 7;
#endif
#ifdef __AVX512FP16__
  bits |= 1 << 8;
#endif
#ifdef __AVX512BF16__
  bits |= 1 << 9;
#endif
#if defined(__ARM_NEON) || defined(__ARM_NEON__)
  bits |= 1 << 16;
#endif
#ifdef __ARM_FEATURE_FP16_VECTOR_ARITHMETIC
  bits |= 1 << 17;
#endif
  return bits;
}

}  // extern "C"
