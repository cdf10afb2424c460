// The online-softmax core shared by the CPU attention kernels: a work item's query rows
// against a stream of 16-row chunks of float32 keys and values.
#pragma once

#include <type_traits>

#include "native.h"

namespace kvjax {

inline int64_t round16(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// Vectors of the target's width (native.h) per v16: the register-blocked loops compute in
// those (GCC keeps arrays of v16 in memory on a 32-byte target and moves every accumulator
// through the stack: the AVX2 build's logits ran at 15%, its value sums at 8% of its FMA
// peak).
constexpr int kHalves = kLanes / kNat;

// One chunk of 16 key/value rows of element type E (float, or uint16_t for bfloat16
// bits): row j of the keys at k + j * ks, of the values at v + j * vs. Optionally the
// chunk brings its own query rows (G rows of the key width, in load32's order: natural for
// float; used instead of the item's) and a logit bias per row added to the dot products:
// KIVI keys fold their per-channel scale into the query and their zero point into the
// bias, so the rows hold bare codes.
template <typename E>
struct RowChunk {
  const E* k;
  int64_t ks;
  const E* v;
  int64_t vs;
  const float* q = nullptr;     // [G, D] or nullptr: the item's query rows
  const float* bias = nullptr;  // [G] or nullptr: no bias
};
// The float32 chunk of the staging `attend` (widths padded to a multiple of 16 with zeros).
using Chunk = RowChunk<float>;

// Folds one chunk's logits `s` of a query row into its running max `m` and per-lane sums
// `lsum` (added up once at the end): the rescale of the earlier accumulator (`alpha`) and
// the chunk's probabilities (to `probs`). Masked lanes (not `visible`) get probability 0;
// a chunk has at least one visible lane. The max moves only when a logit exceeds it (for
// most chunks after the first few it does not): only then the horizontal max, the exp
// and the rescale; else alpha = 1 and the chunk costs one compare (measured: a scalar
// exp, a horizontal max and sum per row and chunk were a quarter of the cached step).
// Always inlined: GCC otherwise calls it, and the call costs ~4% of the cached step.
__attribute__((always_inline)) inline void softmax_step(v16 s, v16i visible, float soft_cap,
                                                       float& m, v16& lsum, float& alpha,
                                                       float* probs) {
  if (soft_cap > 0.0f) s = soft_cap * vtanh(s / soft_cap);
  s = select(visible, s, splat(kNegInf));
  if (any(gt(s, splat(m)))) {
    const float m_new = hmax(s);  // > m; finite (a visible lane exceeds m)
    alpha = std::exp(m - m_new);  // 0 on the first chunk (m = -inf)
    lsum *= splat(alpha);
    m = m_new;
  } else {
    alpha = 1.0f;
  }
  const v16 p = vexp(s - splat(m));  // masked lanes: exp(-inf) = 0
  lsum += p;
  store16(probs, p);
}

// Vectors the loops of `attend` keep live, within common.h's register budget kAccVecs.
constexpr int kLogitTokens = kAccVecs;              // tokens whose partial sums a pass keeps
constexpr int kValueVecs = kAccVecs < 8 ? kAccVecs : 8;  // accumulators of a value pass

// Online-softmax attention of G query rows over the chunks of positions [lo, hi).
// `load(c0)` returns the Chunk of positions [c0, c0 + 16) (positions outside [lo, hi)
// may hold anything finite: they are masked); `prefetch(c0)` hints the memory of a later
// chunk. DT / DVT are the padded key / value widths when known at compile time (0: use
// Dp / Dvp), so the common head dims get fully unrolled loops with immediate offsets.
template <int DT, int DVT, typename Load, typename Prefetch>
void attend(const Tuning& tuning, const float* qs, int64_t G, int64_t Dp_rt, int64_t Dvp_rt,
            int64_t Dv, int64_t lo, int64_t hi, float soft_cap, Load&& load, Prefetch&& prefetch,
            float* acc, float* probs, float* out, float* lse) {
  const int64_t Dp = DT ? DT : Dp_rt, Dvp = DVT ? DVT : Dvp_rt;
  float m[kMaxGroup], alpha[kMaxGroup];
  v16 lsum[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) m[g] = kNegInf, lsum[g] = v16{};
  const v16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int64_t ahead = tuning.prefetch;
  const int64_t first = lo / kLanes * kLanes;
  for (int64_t i = 0; i < ahead; ++i) prefetch(first + i * kLanes);

  for (int64_t c0 = first; c0 < hi; c0 += kLanes) {
    if (ahead > 0 && c0 + ahead * kLanes < hi) prefetch(c0 + ahead * kLanes);
    const Chunk ch = load(c0);
    const v16 pos = iota + static_cast<float>(c0);
    const v16i visible = ge(pos, splat(static_cast<float>(lo))) & lt(pos, splat(static_cast<float>(hi)));

    for (int64_t g = 0; g < G; ++g) {
      v16 part[kLanes];
      const float* qg = (ch.q ? ch.q : qs) + g * Dp;
      for (int j0 = 0; j0 < kLanes; j0 += kLogitTokens) {
        // Per-lane partial sums in vectors of the target's width (kHalves per v16).
        vn p[kLogitTokens][kHalves];
        for (int j = 0; j < kLogitTokens; ++j)
          for (int h = 0; h < kHalves; ++h) p[j][h] = vn{};
        for (int64_t d = 0; d < Dp; d += kLanes) {
          for (int h = 0; h < kHalves; ++h) {
            const vn qv = loadn(qg + d + h * kNat);
            for (int j = 0; j < kLogitTokens; ++j)
              p[j][h] += qv * loadn(ch.k + (j0 + j) * ch.ks + d + h * kNat);
          }
        }
        for (int j = 0; j < kLogitTokens; ++j)
          for (int h = 0; h < kHalves; ++h)
            storen(reinterpret_cast<float*>(part + j0 + j) + h * kNat, p[j][h]);
      }
      v16 s = sum_rows(part);
      if (ch.bias) s += ch.bias[g];
      softmax_step(s, visible, soft_cap, m[g], lsum[g], alpha[g], probs + g * kLanes);
    }

    // acc[g] = alpha[g] * acc[g] + sum_j p[g][j] v[j], kValueVecs vectors of acc at a time
    // held in registers across the 16 rows.
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = probs + g * kLanes;
      float* ag = acc + g * Dvp;
      for (int64_t d0 = 0; d0 < Dvp; d0 += kValueVecs * kLanes) {
        const int64_t nv = std::min<int64_t>(kValueVecs, (Dvp - d0) / kLanes) * kHalves;
        vn x[kValueVecs * kHalves];
        for (int64_t i = 0; i < nv; ++i) x[i] = loadn(ag + d0 + i * kNat) * alpha[g];
        for (int j = 0; j < kLanes; ++j) {
          const vn pj = broadcast(pg + j);
          const float* vr = ch.v + j * ch.vs + d0;
          for (int64_t i = 0; i < nv; ++i) x[i] += pj * loadn(vr + i * kNat);
        }
        for (int64_t i = 0; i < nv; ++i) storen(ag + d0 + i * kNat, x[i]);
      }
    }
  }

  for (int64_t g = 0; g < G; ++g) {
    const float l = hsum(lsum[g]);
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < Dv; ++d) out[g * Dv + d] = acc[g * Dvp + d] * inv;
    lse[g] = m[g] + std::log(l);
  }
}

// bfloat16 rows used in place: 32 values (64 bytes) load as 16 int32 lanes, lane i
// holding elements 2i (low half) and 2i + 1 (high half). `lane << 16` is element 2i as a
// float32 and `lane & 0xffff0000` element 2i + 1: two integer ops widen 32 values in
// registers, with no staging copy. Query rows and accumulators are kept in the matching
// "split" order (per block of 32: the 16 even elements, then the 16 odd ones).
typedef int32_t v16iu __attribute__((vector_size(64), aligned(2), may_alias));

inline void bf16_split(const uint16_t* p, v16& even, v16& odd) {
  const v16i w = *reinterpret_cast<const v16iu*>(p);
  const v16i e = w << 16, o = w & static_cast<int32_t>(0xffff0000u);
  even = (v16)e;  // same-size vector casts reinterpret the bits
  odd = (v16)o;
}

// 32 consecutive row elements as two float32 vectors: bfloat16 in split order, float32
// in natural order (elements 0-15, 16-31).
inline void load32(const uint16_t* p, v16& a, v16& b) { bf16_split(p, a, b); }
inline void load32(const float* p, v16& a, v16& b) {
  a = load16(p);
  b = load16(p + kLanes);
}

// load32 in vectors of the target's width: the two v16 of load32 as kHalves vectors each.
inline void load32n(const float* p, vn* a, vn* b) {
  for (int h = 0; h < kHalves; ++h) {
    a[h] = loadn(p + h * kNat);
    b[h] = loadn(p + kLanes + h * kNat);
  }
}
// bfloat16: each kNat int32 lanes hold elements 2i and 2i + 1 of 2 kNat bf16 values, so
// vector h of the even (odd) part is elements 2i (2i + 1) of the h-th 2 kNat values.
inline void load32n(const uint16_t* p, vn* a, vn* b) {
  for (int h = 0; h < kHalves; ++h) {
    const vni w = *reinterpret_cast<const vniu*>(p + 2 * h * kNat);
    const vni e = w << 16, o = w & static_cast<int32_t>(0xffff0000u);
    a[h] = (vn)e;
    b[h] = (vn)o;
  }
}

// To and from the split order of a width that is a multiple of 32.
inline void to_split(const float* src, float* dst, int64_t n) {
  for (int64_t b = 0; b < n; b += 2 * kLanes)
    for (int i = 0; i < kLanes; ++i) {
      dst[b + i] = src[b + 2 * i];
      dst[b + kLanes + i] = src[b + 2 * i + 1];
    }
}
inline void from_split(const float* src, float* dst, int64_t n, float scale) {
  for (int64_t b = 0; b < n; b += 2 * kLanes)
    for (int i = 0; i < kLanes; ++i) {
      dst[b + 2 * i] = src[b + i] * scale;
      dst[b + 2 * i + 1] = src[b + kLanes + i] * scale;
    }
}


// Prefetches the n elements of one row into L2 (with the early touch below, the L2 hint
// measured 0.93-0.96x of the L1 hint on scattered bf16 pages).
template <typename E>
inline void prefetch_row(const E* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < n * static_cast<int64_t>(sizeof(E)); o += 64) prefetch_line<1>(c + o);
}

// The first lines of n bytes at p, and the first line of each later 4 KiB page they
// span, into L2: a chunk's pages touched a few chunks before the spread prefetch asks for
// all of their lines (measured: 0.83-0.96x on scattered bf16 pages, f32 0.95-0.97x; the
// same with huge pages, so not the page walk: the touch starts the pages' memory streams
// early). Whole chunks prefetched that far ahead were slower (a burst of prefetches fills
// the core's miss buffers).
inline void touch_bytes(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < std::min<int64_t>(n, 512); o += 64) prefetch_line<1>(c + o);
  for (int64_t o = 4096 - static_cast<int64_t>(reinterpret_cast<uintptr_t>(c) & 4095); o < n;
       o += 4096)
    prefetch_line<1>(c + o);
}

// Touches the pages of a chunk whose rows are in place (located) early.
template <typename E>
inline void touch_early(const RowChunk<E>& ch) {
  touch_bytes(ch.k, kLanes * ch.ks * static_cast<int64_t>(sizeof(E)));
  touch_bytes(ch.v, kLanes * ch.vs * static_cast<int64_t>(sizeof(E)));
}

// The logits of query rows [g0, g0 + NB) against one chunk's 16 key rows: each key vector
// is loaded (and widened) once for the NB rows, whose partial sums stay in registers;
// parts[r * 16 + j] = lane partial sums of row g0 + r and token j. With `pf`, row j of
// that later chunk's keys and values is prefetched in step j: spread over the chunk's
// arithmetic, a few lines are in flight at a time (a burst of a whole chunk's prefetches
// fills the core's miss buffers and stalls the arithmetic behind it).
template <int NB, int DT, typename E>
inline void chunk_logits(const float* qsplit, int64_t D_rt, const RowChunk<E>& ch, v16* parts,
                         const RowChunk<E>* pf = nullptr) {
  const int64_t D = DT ? DT : D_rt;
  for (int j = 0; j < kLanes; ++j) {
    if (pf) {
      prefetch_row(pf->k + j * pf->ks, D);
      prefetch_row(pf->v + j * pf->vs, pf->vs);  // rows in place: stride = width
    }
    vn a[NB][kHalves];
    for (int r = 0; r < NB; ++r)
      for (int h = 0; h < kHalves; ++h) a[r][h] = vn{};
    const E* kr = ch.k + j * ch.ks;
    for (int64_t d = 0; d < D; d += 2 * kLanes) {
      vn ke[kHalves], ko[kHalves];
      load32n(kr + d, ke, ko);
      for (int r = 0; r < NB; ++r)
        for (int h = 0; h < kHalves; ++h) {
          a[r][h] += loadn(qsplit + r * D + d + h * kNat) * ke[h];
          a[r][h] += loadn(qsplit + r * D + d + kLanes + h * kNat) * ko[h];
        }
    }
    for (int r = 0; r < NB; ++r)
      for (int h = 0; h < kHalves; ++h)
        storen(reinterpret_cast<float*>(parts + r * kLanes + j) + h * kNat, a[r][h]);
  }
}

// acc[r] = alpha[r] * acc[r] + sum_j probs[r][j] v[j] for rows [g0, g0 + NB) (load32's
// order), one block of 32 channels at a time with the NB rows' accumulators in registers.
template <int NB, int DVT, typename E>
inline void chunk_accumulate(float* acc, int64_t Dv_rt, const float* alpha, const float* probs,
                             const RowChunk<E>& ch) {
  const int64_t Dv = DVT ? DVT : Dv_rt;
  for (int64_t d = 0; d < Dv; d += 2 * kLanes) {
    vn xe[NB][kHalves], xo[NB][kHalves];
    for (int r = 0; r < NB; ++r)
      for (int h = 0; h < kHalves; ++h) {
        xe[r][h] = rounded(loadn(acc + r * Dv + d + h * kNat) * alpha[r]);
        xo[r][h] = rounded(loadn(acc + r * Dv + d + kLanes + h * kNat) * alpha[r]);
      }
    for (int j = 0; j < kLanes; ++j) {
      vn ve[kHalves], vo[kHalves];
      load32n(ch.v + j * ch.vs + d, ve, vo);
      for (int r = 0; r < NB; ++r) {
        const vn pj = broadcast(probs + r * kLanes + j);
        for (int h = 0; h < kHalves; ++h) {
          xe[r][h] += pj * ve[h];
          xo[r][h] += pj * vo[h];
        }
      }
    }
    for (int r = 0; r < NB; ++r)
      for (int h = 0; h < kHalves; ++h) {
        storen(acc + r * Dv + d + h * kNat, xe[r][h]);
        storen(acc + r * Dv + d + kLanes + h * kNat, xo[r][h]);
      }
  }
}

// Calls fn(std::integral_constant<int, NB>, g0) over blocks of query rows covering [0, G):
// 8 at a time when G is a multiple of 8, else 4 at a time and the rest one by one; never
// more than MaxNB at a time (then MaxNB, and the rest one by one).
template <int MaxNB = 8, typename Fn>
inline void for_row_blocks(int64_t G, Fn&& fn) {
  int64_t g0 = 0;
  if constexpr (MaxNB >= 8) {
    if (G % 8 == 0) {
      for (; g0 < G; g0 += 8) fn(std::integral_constant<int, 8>{}, g0);
      return;
    }
  }
  constexpr int NB = MaxNB < 4 ? MaxNB : 4;
  for (; g0 + NB <= G; g0 += NB) fn(std::integral_constant<int, NB>{}, g0);
  for (; g0 < G; ++g0) fn(std::integral_constant<int, 1>{}, g0);
}

// Query rows per register block of rows read in place (RowChunk): chunk_logits keeps NB
// rows' partial sums (NB v16), chunk_accumulate 2 NB accumulators (two per 32 channels).
// A v16 is one of AVX-512's 32 zmm registers but two of AVX2's 16 ymm: 8 rows there spilled
// both loops to the stack (MLA decode, 16 query rows per item, ran at 0.5x of the XLA
// path on an AVX2 build). Other chunk types (KIVI codes) block their own rows.
#ifdef __AVX512F__
constexpr int kLogitRowBlock = 8;
constexpr int kValueRowBlock = 8;
#else
constexpr int kLogitRowBlock = 4;
constexpr int kValueRowBlock = 2;
#endif
template <typename C>
constexpr bool kRowsInPlace = false;
template <typename E>
constexpr bool kRowsInPlace<RowChunk<E>> = true;

// Query row g's logits of a chunk from its 16 partial-sum vectors (chunk_logits), plus the
// chunk's logit bias when it has one.
template <typename E>
inline v16 chunk_scores(const RowChunk<E>& ch, const v16* parts, int64_t g) {
  v16 s = sum_rows(parts);
  if (ch.bias) s += splat(ch.bias[g]);
  return s;
}

// Whether locate() found the chunk's rows in place.
template <typename E>
inline bool located(const RowChunk<E>& ch) { return ch.k != nullptr; }

// The running online-softmax state of G query rows of `attend_rows`, in one 64-byte
// aligned block: per-lane softmax sums [G] vectors, queries [G, D] and accumulators
// [G, Dv] (both in split order for bfloat16 rows), running maxima [G]. The rows of a
// state are independent: the state of rows [g0, g1) is the same memory ranges of a
// state of G rows, so a state can be filled for many sequences' rows at once and
// continued by each sequence alone (paged_decode.cc: pages shared by several sequences).
struct RowState {
  v16* lsum;
  float* q;
  float* acc;
  float* m;

  static int64_t floats(int64_t G, int64_t D, int64_t Dv) {
    return G * kLanes + G * D + G * Dv + round16(G);
  }
  // The state of G rows in `mem` (64-byte aligned, floats(G, D, Dv) floats; D, Dv
  // multiples of 32 keep every part aligned).
  static RowState at(float* mem, int64_t G, int64_t D, int64_t Dv) {
    RowState s;
    s.lsum = reinterpret_cast<v16*>(mem);
    s.q = mem + G * kLanes;
    s.acc = s.q + G * D;
    s.m = s.acc + G * Dv;
    return s;
  }
};

// A 64-byte aligned float buffer.
using AlignedFloats = std::unique_ptr<float[], void (*)(void*)>;
inline AlignedFloats aligned_floats(int64_t n) {
  return AlignedFloats(
      static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64)), std::free);
}

// Starts a state: queries qs [G, D] (scaled) in split order when `split`, no
// probability mass yet.
inline void row_state_start(const RowState& st, const float* qs, int64_t G, int64_t D,
                            int64_t Dv, bool split) {
  for (int64_t g = 0; g < G; ++g) {
    if (split) {
      to_split(qs + g * D, st.q + g * D, D);
    } else {
      std::memcpy(st.q + g * D, qs + g * D, D * sizeof(float));
    }
  }
  std::fill(st.acc, st.acc + G * Dv, 0.0f);
  for (int64_t g = 0; g < G; ++g) st.m[g] = kNegInf, st.lsum[g] = v16{};
}

// Normalizes a state into out [G, Dv] and lse [G].
inline void row_state_finish(const RowState& st, int64_t G, int64_t Dv, bool split, float* out,
                             float* lse) {
  for (int64_t g = 0; g < G; ++g) {
    const float l = hsum(st.lsum[g]);
    const float inv = 1.0f / l;
    if (split) {
      from_split(st.acc + g * Dv, out + g * Dv, Dv, inv);
    } else {
      for (int64_t d = 0; d < Dv; ++d) out[g * Dv + d] = st.acc[g * Dv + d] * inv;
    }
    lse[g] = st.m[g] + std::log(l);
  }
}

// Whether chunks of type C hold bfloat16 rows (states in split order).
template <typename C>
constexpr bool kSplitRows = std::is_same_v<C, RowChunk<uint16_t>>;

// The chunks [begin, hi) of `attend_rows` (begin a multiple of 16) folded into a state
// of G rows; positions outside [lo, hi) are masked.
template <typename C, int DT, int DVT, typename Load, typename Prefetch, typename Locate>
void attend_rows_run(const Tuning& tuning, const RowState& st, int64_t G, int64_t D_rt,
                     int64_t Dv_rt, int64_t begin, int64_t lo, int64_t hi, float soft_cap,
                     Load&& load, Prefetch&& prefetch, Locate&& locate) {
  const int64_t D = DT ? DT : D_rt, Dv = DVT ? DVT : Dv_rt;
  if (begin >= hi) return;
  // Scratch: the per-token partial sums of two chunks [2, G, 16] vectors, probabilities
  // [G, 16], alpha [G].
  AlignedFloats buf = aligned_floats(2 * G * kLanes * kLanes + G * kLanes + round16(G));
  v16* parts[2] = {reinterpret_cast<v16*>(buf.get()),
                   reinterpret_cast<v16*>(buf.get()) + G * kLanes};
  float* probs = reinterpret_cast<float*>(parts[1] + G * kLanes);
  float* alpha = probs + G * kLanes;
  float* qsplit = st.q;
  float* acc = st.acc;
  float* m = st.m;
  v16* lsum = st.lsum;
  // Rows in place are touched early (touch_early); the KIVI kernel's code chunks are not:
  // that measured 1.05-1.11x slower (its chunks are compute-bound).
  constexpr bool is_rows = kSplitRows<C> || std::is_same_v<C, RowChunk<float>>;
  const v16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int64_t ahead = tuning.prefetch, touch = tuning.touch;
  const int64_t first = begin;
  // The keys of chunk c + 1 are read in iteration c: prefetch `ahead` chunks past that.
  for (int64_t i = 0; i <= ahead; ++i) prefetch(first + i * kLanes);
  constexpr int logit_rows = kRowsInPlace<C> ? kLogitRowBlock : 8;
  constexpr int value_rows = kRowsInPlace<C> ? kValueRowBlock : 8;
  auto logits = [&](const C& ch, v16* out_parts, const C* pf) {
    for_row_blocks<logit_rows>(G, [&](auto nb, int64_t g0) {
      chunk_logits<decltype(nb)::value, DT>((ch.q ? ch.q : qsplit) + g0 * D, D, ch,
                                            out_parts + g0 * kLanes, g0 == 0 ? pf : nullptr);
    });
  };

  // Software-pipelined: the logits of chunk c + 1 are computed between chunk c's softmax
  // (a chain of dependent horizontal ops) and its value accumulation (which waits on
  // it), so the out-of-order core has independent work while the chain resolves.
  C ch = load(first);
  logits(ch, parts[0], nullptr);
  int cur = 0;
  for (int64_t c0 = first; c0 < hi; c0 += kLanes) {
    if constexpr (is_rows) {
      if (touch > 0 && c0 + touch * kLanes < hi) {
        const C early = locate(c0 + touch * kLanes);
        if (located(early)) touch_early(early);
      }
    }
    C pf{};
    if (ahead > 0 && c0 + (ahead + 1) * kLanes < hi) {
      pf = locate(c0 + (ahead + 1) * kLanes);
      if (!located(pf)) prefetch(c0 + (ahead + 1) * kLanes);
    }
    const v16 pos = iota + static_cast<float>(c0);
    const v16i visible = ge(pos, splat(static_cast<float>(lo))) & lt(pos, splat(static_cast<float>(hi)));
    for (int64_t g = 0; g < G; ++g) {
      const v16 s = chunk_scores(ch, parts[cur] + g * kLanes, g);
      softmax_step(s, visible, soft_cap, m[g], lsum[g], alpha[g], probs + g * kLanes);
    }
    const C now = ch;
    if (c0 + kLanes < hi) {
      ch = load(c0 + kLanes);
      logits(ch, parts[cur ^ 1], located(pf) ? &pf : nullptr);
    }
    for_row_blocks<value_rows>(G, [&](auto nb, int64_t g0) {
      chunk_accumulate<decltype(nb)::value, DVT>(acc + g0 * Dv, Dv, alpha + g0,
                                                 probs + g0 * kLanes, now);
    });
    cur ^= 1;
  }
}

// `attend` for chunks of type C: RowChunk<E> of float32 or bfloat16 (E = uint16_t) rows,
// or another chunk type with its own chunk_logits / chunk_scores / chunk_accumulate /
// located overloads
// (the KIVI kernel's codes read in place, quantized_kernel.h), and head widths D, Dv
// multiples of 32: rows used in place (bf16 widened in registers, load32), query rows
// taken in register blocks (chunk_logits / chunk_accumulate). Two chunks are live at a
// time: `load` must not reuse a chunk's memory before the chunk after next
// (paged_decode.cc alternates two stage buffers). `locate(c0)` gives a chunk in place
// for the spread prefetch (located(chunk) false where it is not: `prefetch(c0)` then
// hints the chunk at once). qs: [G, D] scaled queries; out: [G, Dv]. A row's arithmetic
// does not depend on the other rows of the call, nor on where a run of chunks is cut
// (attend_rows_run): both orders give the same bits.
template <typename C, int DT, int DVT, typename Load, typename Prefetch, typename Locate>
void attend_rows(const Tuning& tuning, const float* qs, int64_t G, int64_t D_rt, int64_t Dv_rt,
                 int64_t lo, int64_t hi, float soft_cap, Load&& load, Prefetch&& prefetch,
                 Locate&& locate, float* out, float* lse) {
  const int64_t D = DT ? DT : D_rt, Dv = DVT ? DVT : Dv_rt;
  AlignedFloats mem = aligned_floats(RowState::floats(G, D, Dv));
  const RowState st = RowState::at(mem.get(), G, D, Dv);
  row_state_start(st, qs, G, D, Dv, kSplitRows<C>);
  attend_rows_run<C, DT, DVT>(tuning, st, G, D, Dv, lo / kLanes * kLanes, lo, hi, soft_cap,
                              load, prefetch, locate);
  row_state_finish(st, G, Dv, kSplitRows<C>, out, lse);
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
  for (int64_t o = 0; o < n; o += 64) prefetch_line(c + o);
}


}  // namespace kvjax
