// The online-softmax core shared by the CPU attention kernels: a work item's query rows
// against a stream of 16-row chunks of float32 keys and values.
#pragma once

#include <type_traits>

#include "common.h"

namespace kvjax {

// Chunks of 16 tokens prefetched ahead (KVJAX_CPU_PREFETCH overrides, 0 disables).
inline int64_t prefetch_chunks() {
  static const int64_t n = [] {
    const char* env = std::getenv("KVJAX_CPU_PREFETCH");
    return env ? std::atoll(env) : 1;
  }();
  return n;
}

inline int64_t round16(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// One chunk of 16 key/value rows as float32: row j of the keys at k + j * ks (ks floats
// apart, the width padded to a multiple of 16 with zeros), of the values at v + j * vs.
// Optionally the chunk brings its own query rows (G rows of the padded key width, used
// instead of the item's) and a logit bias per row added to the dot products: KIVI keys
// fold their per-channel scale into the query and their zero point into the bias, so the
// rows hold bare codes.
struct Chunk {
  const float* k;
  int64_t ks;
  const float* v;
  int64_t vs;
  const float* q = nullptr;     // [G, Dp] or nullptr: the item's query rows
  const float* bias = nullptr;  // [G] or nullptr: no bias
};

// Online-softmax attention of G query rows over the chunks of positions [lo, hi).
// `load(c0)` returns the Chunk of positions [c0, c0 + 16) (positions outside [lo, hi)
// may hold anything finite: they are masked); `prefetch(c0)` hints the memory of a later
// chunk. DT / DVT are the padded key / value widths when known at compile time (0: use
// Dp / Dvp), so the common head dims get fully unrolled loops with immediate offsets.
template <int DT, int DVT, typename Load, typename Prefetch>
void attend(const float* qs, int64_t G, int64_t Dp_rt, int64_t Dvp_rt, int64_t Dv, int64_t lo,
            int64_t hi, float soft_cap, Load&& load, Prefetch&& prefetch, float* acc,
            float* probs, float* out, float* lse) {
  const int64_t Dp = DT ? DT : Dp_rt, Dvp = DVT ? DVT : Dvp_rt;
  float m[kMaxGroup], l[kMaxGroup], alpha[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) m[g] = kNegInf, l[g] = 0.0f;
  const v16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int64_t ahead = prefetch_chunks();
  const int64_t first = lo / kLanes * kLanes;
  for (int64_t i = 0; i < ahead; ++i) prefetch(first + i * kLanes);

  for (int64_t c0 = first; c0 < hi; c0 += kLanes) {
    if (ahead > 0 && c0 + ahead * kLanes < hi) prefetch(c0 + ahead * kLanes);
    const Chunk ch = load(c0);
    const v16 pos = iota + static_cast<float>(c0);
    const v16i visible = (pos >= static_cast<float>(lo)) & (pos < static_cast<float>(hi));

    for (int64_t g = 0; g < G; ++g) {
      v16 part[kLanes];
      for (int j = 0; j < kLanes; ++j) part[j] = v16{};
      const float* qg = (ch.q ? ch.q : qs) + g * Dp;
      for (int64_t d = 0; d < Dp; d += kLanes) {
        const v16 qv = load16(qg + d);
        for (int j = 0; j < kLanes; ++j) part[j] += qv * load16(ch.k + j * ch.ks + d);
      }
      v16 s = sum_rows(part);
      if (ch.bias) s += ch.bias[g];
      if (soft_cap > 0.0f) s = soft_cap * vtanh(s / soft_cap);
      s = visible ? s : splat(kNegInf);
      const float m_new = std::max(m[g], hmax(s));  // finite: the chunk has a visible lane
      alpha[g] = std::exp(m[g] - m_new);            // 0 on the first chunk (m = -inf)
      const v16 p = vexp(s - m_new);                // masked lanes: exp(-inf) = 0
      l[g] = l[g] * alpha[g] + hsum(p);
      m[g] = m_new;
      store16(probs + g * kLanes, p);
    }

    // acc[g] = alpha[g] * acc[g] + sum_j p[g][j] v[j], 8 vectors of acc at a time held in
    // registers across the 16 rows.
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = probs + g * kLanes;
      float* ag = acc + g * Dvp;
      const v16 al = splat(alpha[g]);
      for (int64_t d0 = 0; d0 < Dvp; d0 += 8 * kLanes) {
        const int64_t nv = std::min<int64_t>(8, (Dvp - d0) / kLanes);
        v16 x[8];
        for (int64_t i = 0; i < nv; ++i) x[i] = load16(ag + d0 + i * kLanes) * al;
        for (int j = 0; j < kLanes; ++j) {
          const v16 pj = splat(pg[j]);
          const float* vr = ch.v + j * ch.vs + d0;
          for (int64_t i = 0; i < nv; ++i) x[i] += pj * load16(vr + i * kLanes);
        }
        for (int64_t i = 0; i < nv; ++i) store16(ag + d0 + i * kLanes, x[i]);
      }
    }
  }

  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.0f / l[g];
    for (int64_t d = 0; d < Dv; ++d) out[g * Dv + d] = acc[g * Dvp + d] * inv;
    lse[g] = m[g] + std::log(l[g]);
  }
}

// Copies (float32) or widens (bf16, float16) `width` values to dst and zero-pads to `padded`.
template <typename T>
inline void to_f32(const T* src, int64_t width, int64_t padded, float* dst) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, width * sizeof(float));
  } else if constexpr (std::is_same_v<T, Bf16>) {
    widen_bf16(reinterpret_cast<const uint16_t*>(src), dst, width);
  } else {
    widen_f16(src, dst, width);
  }
  for (int64_t d = width; d < padded; ++d) dst[d] = 0.0f;
}

inline void prefetch_bytes(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(c + o, 0, 3);
}


}  // namespace kvjax
