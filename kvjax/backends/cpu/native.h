// Vectors of the target's own width, for register-blocked loops (the matmul, the prefill
// attention): kNat floats, 16 with AVX-512, 8 with AVX/AVX2, 4 elsewhere. GCC lowers the
// 64-byte vectors of common.h on a 32-byte target through the stack when many are live
// (most FMAs of an AVX2 build read a spilled operand), so a loop that keeps a block of
// accumulators in registers uses these instead: 32 zmm registers on AVX-512, 16 ymm on
// AVX2, 16 xmm (SSE2) or 32 (NEON) elsewhere.
#pragma once

#include "common.h"

namespace kvjax {

#if defined(__AVX512F__)
#define KVJAX_NAT 16
#elif defined(__AVX__)
#define KVJAX_NAT 8
#else
#define KVJAX_NAT 4
#endif
constexpr int kNat = KVJAX_NAT;
typedef float vn __attribute__((vector_size(4 * kNat)));
typedef int32_t vni __attribute__((vector_size(4 * kNat)));
typedef float vnu __attribute__((vector_size(4 * kNat), aligned(4), may_alias));
typedef int32_t vniu __attribute__((vector_size(4 * kNat), aligned(2), may_alias));

inline vn loadn(const float* p) { return *reinterpret_cast<const vnu*>(p); }
inline void storen(float* p, vn x) { *reinterpret_cast<vnu*>(p) = x; }

// x[0] in all lanes, loaded as a broadcast (`vn{} + v` would add 0.0f first, an extra
// instruction per row and step that the compiler must keep for -0.0f).
inline vn broadcast(const float* p) {
  const float v = *p;
#if KVJAX_NAT == 16
  return vn{v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v};
#elif KVJAX_NAT == 8
  return vn{v, v, v, v, v, v, v, v};
#else
  return vn{v, v, v, v};
#endif
}

// x, held as a rounded value: no later multiply-add may fuse the product that made it.
// Where an add takes two products (`x = acc * alpha; x += p * v`), the compiler fuses one
// of them into an FMA, and which one depends on how it unrolled the loop around them (a
// register block of 8 query rows and one of 1 fused different ones on an AVX-512 build for
// Zen): rounding the first product here leaves one choice, so a row's bits do not depend
// on the rows computed beside it.
inline vn rounded(vn x) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+v"(x));
#elif defined(__aarch64__)
  __asm__("" : "+w"(x));
#else
  __asm__("" : "+m"(x));
#endif
  return x;
}

// Per-thread scratch that lives as long as its thread, grown on demand, 64-byte aligned,
// never shrunk: a fresh allocation per call would fault its pages in on every call.
// Each use site owns its own buffer (a `thread_local Scratch`).
struct Scratch {
  std::unique_ptr<float[], void (*)(void*)> buf{nullptr, std::free};
  int64_t have = 0;
  float* get(int64_t floats) {
    if (floats > have) {
      buf.reset(static_cast<float*>(std::aligned_alloc(64, (floats * 4 + 63) / 64 * 64)));
      have = floats;
    }
    return buf.get();
  }
};

}  // namespace kvjax
