// Decode attention over KIVI-quantized pages and their full-precision tail on CPU.
//
// Same structure as paged_decode.cc: work item = (sequence, KV head), one pass over the
// sequence's quantized tokens in chunks of 16 positions, online softmax in float32. Chunks
// of 16 rows of one page are read in place: the logits and value loops of attend.h's
// register-blocked core take the packed codes (CodeChunk below); the other chunks (the
// edges of the visible range, the tail ring, shapes the in-place path does not cover) are
// unpacked and dequantized, code * scale + zero, into a float32 chunk first (`stage`).
// Layout (kernels_pallas/quantized_attention/layout.py): codes planar-packed along the
// width (field i of byte j is channel i * W/k + j, k = 8 / bits codes per byte); keys'
// scale/zero per channel for groups of G tokens, [page_size / G, width]; values' per token
// for groups of G channels, [page_size, width / G]; scales float16, bfloat16 or float32.
//
// Semantics: the query of sequence b sits at q_pos[b] (< 0: padding, output 0 and lse
// -inf) and sees positions k < min(lengths[b], q_pos[b] + 1) with q_pos[b] - k < window
// when a window is set: k < Q = quant_lengths[b] from the pages, k in [Q, Q + ring) from
// the tail ring (slot k mod ring of tail_k / tail_v [kv_heads, batch, ring, width], f32,
// bf16 or f16), in one online softmax (no merge of two partial results).
//
// This header holds the kernel's templates; each quantized_decode_<dtype>.cc instantiates
// them for one scale dtype.

#pragma once

#include "attend.h"
#include "quantized_decode.h"

namespace kvjax {
namespace {

// One key row (tokens grouping): dst[c] = code(c) * s[c] + z[c], s and z float32 rows.
inline void dequant_key_row(const uint8_t* __restrict codes, int64_t width, int bits,
                            const float* __restrict s, const float* __restrict z,
                            int64_t padded, float* __restrict dst) {
  const int k = 8 / bits;
  const int64_t n = width / k;
  const uint32_t mask = (1u << bits) - 1;
  for (int f = 0; f < k; ++f) {
    float* d = dst + f * n;
    const float* sf = s + f * n;
    const float* zf = z + f * n;
    const int shift = f * bits;
    for (int64_t j = 0; j < n; ++j)
      d[j] = static_cast<float>((codes[j] >> shift) & mask) * sf[j] + zf[j];
  }
  for (int64_t c = width; c < padded; ++c) dst[c] = 0.0f;
}

// One value row (channels grouping): dst[c] = code(c) * s[c / G] + z[c / G].
template <typename S>
inline void dequant_value_row(const uint8_t* __restrict codes, int64_t width, int bits,
                              const S* s, const S* z, int64_t group, int64_t padded,
                              float* __restrict dst) {
  const int k = 8 / bits;
  const int64_t n = width / k;
  const uint32_t mask = (1u << bits) - 1;
  for (int f = 0; f < k; ++f) {
    const int shift = f * bits;
    // Field f is channels [f n, (f + 1) n); walk it in runs that share one group.
    for (int64_t j0 = 0; j0 < n;) {
      const int64_t c0 = f * n + j0, g = c0 / group;
      const int64_t run = std::min(n - j0, (g + 1) * group - c0);
      const float sg = to_float(s[g]), zg = to_float(z[g]);
      float* d = dst + c0;
      const uint8_t* cj = codes + j0;
      for (int64_t j = 0; j < run; ++j)
        d[j] = static_cast<float>((cj[j] >> shift) & mask) * sg + zg;
      j0 += run;
    }
  }
  for (int64_t c = width; c < padded; ++c) dst[c] = 0.0f;
}

typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1), may_alias));

// Bytes p[0, 16) zero-extended to 16 int32 lanes.
inline v16i widen_bytes(const uint8_t* p) {
#ifdef __AVX512F__
  // GCC turns the generic conversion below into byte-by-byte inserts; vpmovzxbd is one op.
  __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<v16i&>(w);
#elif defined(__AVX2__)
  // Same: the generic conversion is byte inserts; two vpmovzxbd of 8 bytes each.
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i lo = _mm256_cvtepu8_epi32(x), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(x, 8));
  v16i w;
  std::memcpy(&w, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&w) + 32, &hi, 32);
  return w;
#else
  return __builtin_convertvector(*reinterpret_cast<const u8x16*>(p), v16i);
#endif
}

// Codes of 16 consecutive bytes' field at bit `shift`, as float32: widen, shift, mask.
template <int BITS>
inline v16 codes16(const uint8_t* p, int shift) {
  v16i x = widen_bytes(p);
  if constexpr (BITS < 8) x = (x >> shift) & ((1 << BITS) - 1);
  return __builtin_convertvector(x, v16);
}

// Vectorised dequantization of one key row (per-channel float32 scale/zero rows) and
// one value row (per-token scales for groups of `group` channels, 16 | group), for
// widths with 16 | width / k (then D and Dv are multiples of 16: no padding). Channels
// are visited in order, field by field (field f = channels [f n, (f + 1) n)).
template <int BITS, typename S>
inline void dequant_rows16(const uint8_t* kcodes, const float* ks, const float* kz,
                           int64_t D, const uint8_t* vcodes, const S* vs, const S* vz,
                           int64_t group, int64_t Dv, float* __restrict kdst,
                           float* __restrict vdst) {
  constexpr int k = 8 / BITS;
  const int64_t n = D / k, nv = Dv / k;
  float* kd = kdst;
  for (int f = 0; f < k; ++f) {
    for (int64_t j = 0; j < n; j += kLanes, kd += kLanes) {
      const int64_t c = kd - kdst;
      store16(kd, codes16<BITS>(kcodes + j, f * BITS) * load16(ks + c) + load16(kz + c));
    }
  }
  float* vd = vdst;
  int64_t g = 0, left = group;
  v16 sg = splat(to_float(vs[0])), zg = splat(to_float(vz[0]));
  for (int f = 0; f < k; ++f) {
    for (int64_t j = 0; j < nv; j += kLanes, vd += kLanes) {
      store16(vd, codes16<BITS>(vcodes + j, f * BITS) * sg + zg);
      if ((left -= kLanes) == 0 && vd + kLanes < vdst + Dv) {
        ++g;
        left = group;
        sg = splat(to_float(vs[g]));
        zg = splat(to_float(vz[g]));
      }
    }
  }
}

// Bare codes of one key row as float32 (the scales folded into the query, the zeros into
// a logit bias): each 16-byte load serves all k fields. Same width condition as above.
template <int BITS>
inline void key_codes16(const uint8_t* kcodes, int64_t D, float* __restrict kdst) {
  constexpr int k = 8 / BITS;
  const int64_t n = D / k;
  for (int64_t j = 0; j < n; j += kLanes) {
    const v16i x = widen_bytes(kcodes + j);
    for (int f = 0; f < k; ++f) {
      v16i c = x;
      if constexpr (BITS < 8) c = (x >> (f * BITS)) & ((1 << BITS) - 1);
      store16(kdst + f * n + j, __builtin_convertvector(c, v16));
    }
  }
}

// Dequantized value row, code * s[group] + z[group], walking the packed bytes once: each
// 16-byte load serves all k fields. `vec_group[i]` is the scale group of channels
// [16 i, 16 i + 16) (16 | group, so a vector never straddles two groups). Same width
// condition as dequant_rows16.
template <int BITS, typename S>
inline void value_row16(const uint8_t* vcodes, const S* vs, const S* vz,
                        const int32_t* vec_group, int64_t Dv, float* __restrict sz,
                        int64_t v_groups, float* __restrict vdst) {
  constexpr int k = 8 / BITS;
  const int64_t n = Dv / k;
  float* zf = sz + v_groups;
  to_f32(vs, v_groups, v_groups, sz);
  to_f32(vz, v_groups, v_groups, zf);
  for (int64_t j = 0; j < n; j += kLanes) {
    const v16i x = widen_bytes(vcodes + j);
    for (int f = 0; f < k; ++f) {
      v16i c = x;
      if constexpr (BITS < 8) c = (x >> (f * BITS)) & ((1 << BITS) - 1);
      const int64_t ch = f * n + j;
      const int32_t g = vec_group[ch / kLanes];
      store16(vdst + ch, __builtin_convertvector(c, v16) * sz[g] + zf[g]);
    }
  }
}

// ---- Codes read in place by attend.h's register-blocked core (attend_rows) ----
//
// Unpacking a chunk into float32 rows and reading them again cost more than the attention
// itself (a store and a reload per value besides the unpacking: the kernel was 1.4-1.6x
// slower than bf16 pages). Here the logits and value loops take the packed codes
// directly: a key code is multiplied by the query row with the group's scales folded in
// (q . (s c + z) = (q s) . c + q . z, the q . z a logit bias), and a value code by its
// token's probability times its group's scale, p s c, with sum_j p_j z_j added once per
// group and chunk.

constexpr int64_t kMaxValueGroups = 16;  // value scale groups per row on the in-place path

// Field f (bits [f BITS, (f + 1) BITS)) of bytes widened to int32 lanes, as float32. With
// AVX-512 a 16-entry table lookup converts 4- and 2-bit codes (vpermps reads the low 4
// bits of each index, so field 0 needs no mask): 1-2 ops per 16 codes, not shift, mask
// and convert.
template <int BITS>
inline v16 code_field(v16i x, int f) {
  if constexpr (BITS == 8) {
    return __builtin_convertvector(x, v16);
  } else {
#ifdef __AVX512F__
    if constexpr (BITS == 4) {
      const v16 codes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      // Field 1 (x >> 4: x is a zero-extended byte) converts on another port than the
      // lookup, which shares one with the widening (measured: 0.97x).
      if (f) return __builtin_convertvector(x >> 4, v16);
      return (v16)_mm512_permutexvar_ps((__m512i)x, (__m512)codes);
    } else {
      // Index bits 0-1 are one field, bits 2-3 the next.
      const v16 low = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
      const v16 high = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
      const v16i i = f >= 2 ? x >> 4 : x;
      return (v16)_mm512_permutexvar_ps((__m512i)i, (__m512)(f & 1 ? high : low));
    }
#else
    return __builtin_convertvector((x >> (f * BITS)) & ((1 << BITS) - 1), v16);
#endif
  }
}

// AVX2 without AVX-512: the integer values below through vpmaddwd (pairs of int16 products
// summed into 8 int32 lanes: vpdpwssd without the accumulate, so a vpaddd after it). On
// AVX2 the float32 code paths are bound by the FMA ports (two per cycle) plus the codes'
// conversions; vpmaddwd does twice an FMA's multiplies and needs no conversion.
#if defined(__AVX2__) && !defined(__AVX512F__)
#define KVJAX_AVX2_INT 1
#endif

// Integer logits (AVX512-VNNI): the folded query rows of a key group rounded to 16-bit
// integers, m = max |q s| of the row mapped to 32767, and the codes' dot products taken in
// int32 (chunk_logits), exact, then scaled by m / 32767. The rounding changes a logit by at
// most (m / 65534) * sum_c code_c: about 2^-16 of the row's largest term per code unit,
// far inside the codes' own quantization error (KVJAX_CPU_INT_LOGITS=0: float32 FMAs).
// AVX2's vpmaddwd logits measured no faster than the float32 FMAs there (AMD EPYC Zen 3:
// 0.9x at 4 bits, 1.0x at 2), so AVX2 builds keep the FMAs.
#ifdef __AVX512VNNI__
constexpr bool kIntLogits = true;
#else
constexpr bool kIntLogits = false;
#endif

// A row of n vectors, row(i) the i-th, whose largest |entry| is m, as int16: its values in
// dst's first 8 n floats, the scale (m / 32767, 0 for a zero row) in float 8 n.
template <typename Row>
inline void store_int_row(Row&& row, int64_t n, float m, float* dst) {
#ifdef __AVX512VNNI__
  const float inv = m > 0.0f ? 32767.0f / m : 0.0f;
  int16_t* qi = reinterpret_cast<int16_t*>(dst);
  for (int64_t i = 0; i < n; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qi + i * kLanes),
                        _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32((__m512)(row(i) * inv))));
  dst[n * kLanes / 2] = m / 32767.0f;  // cvtps: nearest
#else
  (void)row, (void)n, (void)m, (void)dst;
#endif
}

// Row q [D] (D a multiple of 16) as int16 (store_int_row).
inline void int_query_row(const float* q, int64_t D, float* dst) {
  v16 mx{};
  for (int64_t d = 0; d < D; d += kLanes) {
    const v16 x = load16(q + d);
    mx = vmax(mx, vabs(x));
  }
  store_int_row([&](int64_t i) { return load16(q + i * kLanes); }, D / kLanes, hmax(mx), dst);
}

// The query rows qs [G, Dp] with a key group's scales s and zeros z (float32 rows of Dp)
// folded in: bias[g] = qs[g] . z, qfold[g] = qs[g] * s and, for the integer logits
// (qint not null), that row as int_query_row writes it to qint. With the width known at
// compile time the integer rows are made in registers and qfold is not written.
template <int DT>
inline void fold_rows(const float* __restrict qs, int64_t G, int64_t Dp_rt,
                      const float* __restrict s, const float* __restrict z,
                      float* __restrict qfold, float* __restrict qint, float* __restrict bias) {
  const int64_t Dp = DT ? DT : Dp_rt;
#ifdef __AVX512VNNI__
  if constexpr (DT > 0 && DT <= 16 * kLanes) {
    if (qint) {
      constexpr int n = DT / kLanes;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qs + g * Dp;
        v16 x[n], b{}, mx{};
        for (int i = 0; i < n; ++i) {
          const v16 qv = load16(qg + i * kLanes);
          x[i] = qv * load16(s + i * kLanes);
          b += qv * load16(z + i * kLanes);
          mx = vmax(mx, (v16)_mm512_abs_ps((__m512)x[i]));
        }
        bias[g] = hsum(b);
        store_int_row([&](int64_t i) { return x[i]; }, n, hmax(mx), qint + g * Dp);
      }
      return;
    }
  }
#endif
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qs + g * Dp;
    float* row = qfold + g * Dp;
    v16 b{};
    for (int64_t d = 0; d < Dp; d += kLanes) {
      const v16 qv = load16(qg + d);
      store16(row + d, qv * load16(s + d));
      b += qv * load16(z + d);
    }
    bias[g] = hsum(b);
    if (qint) int_query_row(row, Dp, qint + g * Dp);
  }
}

// What the code chunks of one work item share: bytes per key / value row, the values'
// scale groups per row and channels per group, and the bytes a chunk's prefetch covers.
template <typename S>
struct CodeRows {
  int64_t kw = 0, vw = 0;
  int64_t vg = 0, vgroup = 0;
  bool int_logits = false;  // query rows as 16-bit integers (int_query_row)
  int64_t qstride = 0;  // floats per query row (for the integer rows' scales)
  bool int_values = false;  // value weights as 16-bit integers (int_value_weights)
  const int32_t* vec_group = nullptr;  // value group of each 16-channel vector of a row
  // int_value_weights' placement: two blocks of w packed to int16 (vpackssdw) and spread
  // to their padded places, out_index[z] giving output zmm z's source lanes (pad_mask:
  // the lanes of groups below vg; the rest zeroed).
  alignas(64) int16_t out_index[4][2 * kLanes] = {};
  uint32_t pad_mask = 0;
  v16i lane_group{};  // lane i: i mod vg
  int64_t kbytes = 0;   // of the key group's scale row (and of its zero row)
  int64_t vbytes = 0;   // of a chunk's value scales [16, vg] (and of its zeros)
  std::ptrdiff_t kz = 0, vz = 0;  // zeros - scales, in elements (keys, values)
};

// A chunk of 16 rows of one page, its codes in place: key row j at k + j * kw, value row j
// at v + j * vw, the values' scales [16, vg] at vs (zeros at vs + vz), the key group's
// scale row at ks (zeros at ks + kz); q / bias: the query rows with the key group's
// scales folded in and their dot products with its zeros. Chunks that are not whole rows
// of one page (the edges of [lo, hi), the tail ring) are float32 `rows` with k == nullptr.
// Eight pointers (one cache line): attend_rows copies chunks by value.
template <int BITS, typename S>
struct CodeChunk {
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;
  const S* vs = nullptr;
  const S* ks = nullptr;
  const CodeRows<S>* geo = nullptr;
  const float* q = nullptr;
  const float* bias = nullptr;
  const RowChunk<float>* rows = nullptr;
};

template <int BITS, typename S>
inline bool located(const CodeChunk<BITS, S>& ch) { return ch.k != nullptr; }

// Step j of 16 of a chunk's prefetch: line j of its key rows and of its value rows (a
// chunk's 16 rows lie contiguous in its page; 8-bit rows take two lines a step), into L2,
// and of its value scales and zeros and the key group's scale and zero rows (these serve
// 16+ tokens). One line per array and step, spread over the chunk's arithmetic: 0.96x
// of a loop over each row's bytes (at 2 bits that prefetched every line twice); the L2
// hint for the codes a further 0.92-0.99x.
template <int BITS, typename S>
__attribute__((always_inline)) inline void prefetch_codes(const CodeChunk<BITS, S>& ch, int j) {
  const CodeRows<S>& g = *ch.geo;
  const int64_t o = 64 * j, kb = kLanes * g.kw, vb = kLanes * g.vw;
  for (int64_t i = o; i < kb; i += 64 * kLanes) prefetch_line<1>(ch.k + i);
  for (int64_t i = o; i < vb; i += 64 * kLanes) prefetch_line<1>(ch.v + i);
  if (o < g.vbytes) {
    prefetch_line(reinterpret_cast<const char*>(ch.vs) + o);
    prefetch_line(reinterpret_cast<const char*>(ch.vs + g.vz) + o);
  }
  if (o < g.kbytes) {
    prefetch_line(reinterpret_cast<const char*>(ch.ks) + o);
    prefetch_line(reinterpret_cast<const char*>(ch.ks + g.kz) + o);
  }
}

// Logits of query rows [g0, g0 + NB) (q: their rows, natural order) against the chunk's 16
// key rows; as attend.h's chunk_logits, with row j of `pf` prefetched in step j (all of
// pf's rows at once when this chunk is staged float32 rows: the rare edge chunks).
template <int NB, int DT, int BITS, typename S>
__attribute__((always_inline)) inline void chunk_logits(const float* q, int64_t D_rt,
                                                        const CodeChunk<BITS, S>& ch, v16* parts,
                                                        const CodeChunk<BITS, S>* pf = nullptr) {
  if (!ch.k) {
    if (pf)
      for (int j = 0; j < kLanes; ++j) prefetch_codes(*pf, j);
    return chunk_logits<NB, DT>(q, D_rt, *ch.rows, parts);
  }
  constexpr int k = 8 / BITS;
  const int64_t D = DT ? DT : D_rt, n = D / k;  // field f of byte c is channel f n + c
  const int64_t kw = ch.geo->kw;
#ifdef __AVX512VNNI__
  if (ch.geo->int_logits) {
    // 32 codes as 16-bit words against 32 of the row's int16 query values: one vpdpwssd
    // per row (pairs of products summed into 16 int32 lanes) where the float32 path
    // needs two FMAs and a conversion per 16 codes. The partial sums stay int32 (exact;
    // chunk_scores adds them up and scales once per row).
    for (int j = 0; j < kLanes; ++j) {
      if (pf) prefetch_codes(*pf, j);
      __m512i a[NB];
      for (int r = 0; r < NB; ++r) a[r] = _mm512_setzero_si512();
      const uint8_t* kr = ch.k + j * kw;
      for (int64_t c = 0; c < n; c += 2 * kLanes) {
        const __m512i x =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kr + c)));
        for (int f = 0; f < k; ++f) {
          __m512i code = f ? _mm512_srli_epi16(x, f * BITS) : x;
          if constexpr (BITS < 8)
            if (f < k - 1) code = _mm512_and_si512(code, _mm512_set1_epi16((1 << BITS) - 1));
          for (int r = 0; r < NB; ++r)
            a[r] = _mm512_dpwssd_epi32(
                a[r], code, _mm512_loadu_si512(reinterpret_cast<const int16_t*>(q + r * D) +
                                               f * n + c));
        }
      }
      for (int r = 0; r < NB; ++r) parts[r * kLanes + j] = (v16)a[r];  // int32 lanes
    }
    return;
  }
#endif
  if constexpr (NB > kAccVecs) {
    // More rows than accumulators: blocks of rows, each unpacking the codes again.
    for (int r0 = 0; r0 < NB; r0 += kAccVecs)
      chunk_logits<kAccVecs, DT>(q + r0 * D, D, ch, parts + r0 * kLanes, r0 ? nullptr : pf);
    return;
  } else {
    // Two accumulators per row (even and odd fields) where the registers hold them: half
    // the dependent chain.
    constexpr int A = 2 * NB <= kAccVecs ? 2 : 1;
    for (int j = 0; j < kLanes; ++j) {
      if (pf) prefetch_codes(*pf, j);
      v16 a[A][NB];
      for (int r = 0; r < NB; ++r)
        for (int i = 0; i < A; ++i) a[i][r] = v16{};
      const uint8_t* kr = ch.k + j * kw;
      for (int64_t c = 0; c < n; c += kLanes) {
        const v16i x = widen_bytes(kr + c);
        for (int f = 0; f < k; ++f) {
          const v16 code = code_field<BITS>(x, f);
          for (int r = 0; r < NB; ++r) a[f % A][r] += load16(q + r * D + f * n + c) * code;
        }
      }
      for (int r = 0; r < NB; ++r) {
        parts[r * kLanes + j] = a[0][r];
        for (int i = 1; i < A; ++i) parts[r * kLanes + j] += a[i][r];
      }
    }
  }
}

// Lane i: op over the lanes of x congruent to i mod vg (vg a power of two <= 16), pairing
// lanes i and i ^ h for h = 8, 4, 2, 1 down to vg.
template <typename Op>
inline v16 reduce_mod(v16 x, int64_t vg, Op op) {
  if (vg <= 8)
    x = op(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  if (vg <= 4)
    x = op(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  if (vg <= 2)
    x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  if (vg <= 1)
    x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return x;
}

// Query row g's logits of a chunk (attend.h's chunk_scores); on the integer path the
// partial sums are int32: added up exactly, then scaled by the row's int_query_row scale.
template <int BITS, typename S>
inline v16 chunk_scores(const CodeChunk<BITS, S>& ch, const v16* parts, int64_t g) {
  if (!ch.k || !ch.geo->int_logits) {
    v16 s = sum_rows(parts);
    if (ch.bias) s += splat(ch.bias[g]);
    return s;
  }
  const int64_t D = ch.geo->qstride;
  v16i ints[kLanes];
  for (int j = 0; j < kLanes; ++j) ints[j] = (v16i)parts[j];  // bit casts of the values
  const v16i sum = sum_rows(ints);
  return __builtin_convertvector(sum, v16) * splat(ch.q[g * D + D / 2]) + splat(ch.bias[g]);
}

// The value weights of NB rows' probabilities p [NB, 16] over the chunk's tokens:
// w[r][j vg + g] = p[r][j] s[j][g] and z[r][g] = sum_j p[r][j] zero[j][g].
template <int NB, int BITS, typename S>
inline void value_weights(const float* p, const CodeChunk<BITS, S>& ch, float* w, float* z) {
  const int64_t vg = ch.geo->vg, m = kLanes * vg;
  alignas(64) float s[kLanes * kMaxValueGroups], zero[kLanes * kMaxValueGroups];
  to_f32(ch.vs, m, m, s);
  to_f32(ch.vs + ch.geo->vz, m, m, zero);
#ifdef __AVX512F__
  if ((vg & (vg - 1)) == 0) {
    const int lg = __builtin_ctzll(vg);
    const v16i iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int r = 0; r < NB; ++r) {
      const v16 pr = load16(p + r * kLanes);
      v16 zs{};
      for (int64_t b = 0; b < vg; ++b) {
        // Lane i of block b is token (16 b + i) / vg, group i mod vg.
        const v16i tok = (iota + static_cast<int32_t>(b * kLanes)) >> lg;
        const v16 pp = (v16)_mm512_permutexvar_ps((__m512i)tok, (__m512)pr);
        store16(w + r * m + b * kLanes, pp * load16(s + b * kLanes));
        zs += pp * load16(zero + b * kLanes);
      }
      zs = reduce_mod(zs, vg, [](v16 a, v16 b) { return a + b; });
      for (int64_t g = 0; g < vg; ++g) z[r * kMaxValueGroups + g] = zs[g];
    }
    return;
  }
#elif defined(__AVX2__)
  if ((vg & (vg - 1)) == 0 && vg <= 8) {
    // As above in 8-lane halves (the scalar loop below cost as much as the chunk's FMAs):
    // half h's lanes are tokens (8 h + i) / vg, which lie in one aligned 8-token half of
    // the row's probabilities, groups i mod vg.
    const int lg = __builtin_ctzll(vg);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int r = 0; r < NB; ++r) {
      const float* pr = p + r * kLanes;
      __m256 zs = _mm256_setzero_ps();
      for (int64_t h = 0; h < 2 * vg; ++h) {
        const int64_t t0 = (8 * h) >> lg;
        const __m256i tok = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(t0 & 7)),
                                             _mm256_srli_epi32(iota, lg));
        const __m256 pp = _mm256_permutevar8x32_ps(_mm256_loadu_ps(pr + (t0 & ~7)), tok);
        _mm256_storeu_ps(w + r * m + 8 * h, _mm256_mul_ps(pp, _mm256_load_ps(s + 8 * h)));
        zs = _mm256_fmadd_ps(pp, _mm256_load_ps(zero + 8 * h), zs);
      }
      // Lane i: the sum over lanes congruent to i mod vg.
      if (vg <= 4) zs = _mm256_add_ps(zs, _mm256_permute2f128_ps(zs, zs, 1));
      if (vg <= 2) zs = _mm256_add_ps(zs, _mm256_permute_ps(zs, 0x4e));
      if (vg <= 1) zs = _mm256_add_ps(zs, _mm256_permute_ps(zs, 0xb1));
      alignas(32) float zl[8];
      _mm256_store_ps(zl, zs);
      for (int64_t g = 0; g < vg; ++g) z[r * kMaxValueGroups + g] = zl[g];
    }
    return;
  }
#endif
  for (int r = 0; r < NB; ++r) {
    float* zr = z + r * kMaxValueGroups;
    for (int64_t g = 0; g < vg && g < kMaxValueGroups; ++g) zr[g] = 0.0f;  // vg <= 16
    for (int64_t i = 0; i < m; ++i) {
      const float pj = p[r * kLanes + i / vg];
      w[r * m + i] = pj * s[i];
      zr[i % vg] += pj * zero[i];
    }
  }
}

// Integer values (AVX512-VNNI and VBMI, or AVX2's vpmaddwd): a chunk's value weights p s
// rounded to 16-bit integers per query row and value group (the largest over the chunk's
// tokens, m, mapped to 32767) and the codes of a token pair dotted with them by vpdpwssd
// (vpmaddwd), exact int32 sums over the chunk, then scaled by m / 32767 into the float32
// accumulator. A weight moves by at most m / 65534, so a chunk's sum for a channel by at
// most (m / 65534) * sum_j code_j: about 2^-16 of the chunk's largest term per code unit
// (KVJAX_CPU_INT_VALUES=0: FMAs).
#if (defined(__AVX512VNNI__) && defined(__AVX512VBMI__)) || defined(KVJAX_AVX2_INT)
constexpr bool kIntValues = true;
#else
constexpr bool kIntValues = false;
#endif
constexpr int64_t kMaxIntGroups = 8;  // value groups per row on the integer path
// int_value_weights' dwords per query row: 8 token pairs of kMaxIntGroups (a fixed stride,
// so that the value loop reaches row r's weight at a constant offset).
constexpr int64_t kIntRow = kLanes / 2 * kMaxIntGroups;

// vpermb indexes pairing two rows' 16 bytes (a ymm, row j then row j + 1): dword i of the
// result holds byte i of each row as 16-bit words (odd bytes zeroed by the mask), channels
// in order.
struct PairIndex {
  alignas(64) uint8_t b[64];
};
constexpr PairIndex pair_index() {
  PairIndex p{};
  for (int i = 0; i < kLanes; ++i) {
    p.b[4 * i] = static_cast<uint8_t>(i);
    p.b[4 * i + 2] = static_cast<uint8_t>(kLanes + i);
  }
  return p;
}
inline constexpr PairIndex kPairIndex = pair_index();

// value_weights' w as 16-bit integers: wq (int32 pairs of int16) [NB][8][kMaxIntGroups],
// row r's pair t of group g (tokens 2 t and 2 t + 1) at r kIntRow + t kMaxIntGroups + g
// (groups past vg padding); dq[r vg + g] = m / 32767 with m the row's largest |w| of group g
// (vg a power of two <= 8). z as value_weights. The rows' maxima share one division per
// 16 / vg rows (a division per row was a chain of ~20 cycles each).
template <int NB, int BITS, typename S>
inline void int_value_weights(const float* p, const CodeChunk<BITS, S>& ch, int32_t* wq,
                              float* dq, float* z) {
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  const CodeRows<S>& geo = *ch.geo;
  const int64_t vg = geo.vg, m = kLanes * vg;
  alignas(64) float w[NB * kLanes * kMaxIntGroups];
  value_weights<NB>(p, ch, w, z);
  // Lane i of mx[r]: row r's largest |w| of group i mod vg (scales are not negative, but
  // a caller's may be: then m bounds |w| and nothing saturates).
  v16 mx[NB];
  auto mag = [](v16 x) { return (v16)_mm512_abs_ps((__m512)x); };
  for (int r = 0; r < NB; ++r) {
    const float* wr = w + r * m;
    v16 x = mag(load16(wr));
    for (int64_t b = 1; b < vg; ++b) x = vmax(x, mag(load16(wr + b * kLanes)));
    x = reduce_mod(x, vg, [](v16 a, v16 b) { return vmax(a, b); });
    mx[r] = vmax(x, splat(1e-30f));  // a group of zero weights: quantized to 0, no inf
  }
  // Rows r0 .. r0 + 16 / vg - 1 in one vector (lane r vg + g holds row r's group g).
  alignas(64) float inv[NB * kMaxIntGroups + kLanes];
  const int64_t per = kLanes / vg;
  for (int64_t r0 = 0; r0 < NB; r0 += per) {
    v16 x = mx[r0];
    for (int64_t r = r0 + 1; r < std::min<int64_t>(NB, r0 + per); ++r)
      x = (v16)_mm512_mask_blend_ps(static_cast<__mmask16>(((1u << vg) - 1) << ((r - r0) * vg)),
                                    (__m512)x, (__m512)mx[r]);
    store16(inv + r0 * vg, splat(32767.0f) / x);
    store16(dq + r0 * vg, x * (1.0f / 32767.0f));
  }
  const v16i lane_group = geo.lane_group;
  const __m512i zero = _mm512_setzero_si512();
  const int nz = vg == 1 ? 4 : static_cast<int>(kMaxIntGroups / vg);  // outputs per block pair
  for (int r = 0; r < NB; ++r) {
    const float* wr = w + r * m;
    const v16 ir = (v16)_mm512_permutexvar_ps((__m512i)lane_group, (__m512)load16(inv + r * vg));
    int16_t* out = reinterpret_cast<int16_t*>(wq + r * kIntRow);
    for (int64_t b = 0; b < vg; b += 2) {
      const __m512i lo = _mm512_cvtps_epi32((__m512)(load16(wr + b * kLanes) * ir));  // nearest
      const __m512i hi =
          b + 1 < vg ? _mm512_cvtps_epi32((__m512)(load16(wr + (b + 1) * kLanes) * ir)) : zero;
      const __m512i packed = _mm512_packs_epi32(lo, hi);  // saturating; lanes interleaved
      int16_t* dst = out + b * nz * kLanes;  // block pair b / 2: nz outputs of 32
      for (int zi = 0; zi < nz; ++zi)
        _mm512_storeu_si512(dst + zi * 2 * kLanes,
                            _mm512_maskz_permutexvar_epi16(
                                geo.pad_mask, _mm512_load_si512(geo.out_index[zi]), packed));
    }
  }
#elif defined(KVJAX_AVX2_INT)
  // AVX2 (int_accumulate below): the same rounding, dense pairs: row r's pair t of group g
  // at r kIntRow + t vg + g; dq[r kMaxIntGroups + g].
  const int64_t vg = ch.geo->vg, m = kLanes * vg;
  alignas(32) float w[NB * kLanes * kMaxIntGroups];
  value_weights<NB>(p, ch, w, z);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  // Words of a pair of halves (after vpackssdw, and a qword permute below 8 groups, in
  // each 128-bit lane: token 2t's groups then token 2t + 1's) into dword pairs.
  const __m256i pairs = vg == 2 ? _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11,
                                                   14, 15, 0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13,
                                                   10, 11, 14, 15)
                                : _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7,
                                                   14, 15, 0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13,
                                                   6, 7, 14, 15);
  for (int r = 0; r < NB; ++r) {
    const float* wr = w + r * m;
    // Lane i: the row's largest |w| of group i mod vg (vg divides 8: half h's lane i is
    // group i mod vg too).
    __m256 x = _mm256_andnot_ps(sign, _mm256_load_ps(wr));
    for (int64_t h = 1; h < 2 * vg; ++h)
      x = _mm256_max_ps(x, _mm256_andnot_ps(sign, _mm256_load_ps(wr + 8 * h)));
    if (vg <= 4) x = _mm256_max_ps(x, _mm256_permute2f128_ps(x, x, 1));
    if (vg <= 2) x = _mm256_max_ps(x, _mm256_permute_ps(x, 0x4e));
    if (vg <= 1) x = _mm256_max_ps(x, _mm256_permute_ps(x, 0xb1));
    x = _mm256_max_ps(x, _mm256_set1_ps(1e-30f));  // a group of zero weights: no inf
    _mm256_storeu_ps(dq + r * kMaxIntGroups, _mm256_mul_ps(x, _mm256_set1_ps(1.0f / 32767.0f)));
    const __m256 inv = _mm256_div_ps(_mm256_set1_ps(32767.0f), x);
    __m256i* out = reinterpret_cast<__m256i*>(wq + r * kIntRow);
    for (int64_t h = 0; h < 2 * vg; h += 2) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(wr + 8 * h), inv));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(wr + 8 * h + 8), inv));
      __m256i words = _mm256_packs_epi32(a, b);  // saturating; nearest (cvtps)
      if (vg < 8) words = _mm256_permute4x64_epi64(words, 0xd8);
      if (vg > 1) words = _mm256_shuffle_epi8(words, pairs);
      _mm256_storeu_si256(out + h / 2, words);
    }
  }
#else
  (void)p, (void)ch, (void)wq, (void)dq, (void)z;
#endif
}

// acc + the dot products of code's word pairs with the pair at w (broadcast): vpdpwssd
// with its memory operand (GCC does not fold _mm512_set1_epi32 into it: a separate load
// per product, and the loop was front-end bound).
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
inline __m512i dpwssd_bcst(__m512i acc, __m512i code, const int32_t* w) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(code), "m"(*w));
  return acc;
}
#endif

// chunk_accumulate on the integer path, NB rows (NB * k <= 16), a column of 16 bytes of
// each row at a time: per token pair, the two rows' bytes paired as words by one vpermb,
// each field masked / shifted out, and one vpdpwssd per field and query row (the float32
// path: two FMAs and a conversion per 16 codes and row, per token). Writing the loop for
// 32-byte columns (two vpermb from one zmm) measured no faster.
template <int NB, int DVT, int BITS, typename S>
inline void int_accumulate(float* acc, int64_t Dv_rt, const float* alpha, const float* probs,
                           const CodeChunk<BITS, S>& ch) {
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  constexpr int k = 8 / BITS;
  static_assert(NB * k <= 16, "int32 accumulators must fit the registers");
  const int64_t Dv = DVT ? DVT : Dv_rt, n = Dv / k;
  const CodeRows<S>& geo = *ch.geo;
  const int64_t vw = geo.vw, vg = geo.vg;
  alignas(64) int32_t wq[NB * kIntRow];
  alignas(64) float dq[NB * kMaxIntGroups + kLanes];
  float z[NB * kMaxValueGroups];
  int_value_weights<NB>(probs, ch, wq, dq, z);
  const __mmask64 even = 0x5555555555555555ull;
  const __m512i pair = _mm512_load_si512(kPairIndex.b);
  for (int64_t c = 0; c < n; c += kLanes) {
    int64_t gf[k];  // the value group of each field's 16 channels
    const int32_t* wp[k];  // and row 0's weight of its first token pair
    for (int f = 0; f < k; ++f) {
      gf[f] = geo.vec_group[(f * n + c) / kLanes];
      wp[f] = wq + gf[f];
    }
    __m512i a[NB][k];
    for (int r = 0; r < NB; ++r)
      for (int f = 0; f < k; ++f) a[r][f] = _mm512_setzero_si512();
    // Unrolled: GCC otherwise copies every accumulator in and out of the loop.
#pragma GCC unroll 8
    for (int t = 0; t < kLanes / 2; ++t) {
      const uint8_t* row = ch.v + 2 * t * vw + c;
      const __m256i both = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + vw)), 1);
      const __m512i words = _mm512_maskz_permutexvar_epi8(even, pair, _mm512_castsi256_si512(both));
      for (int f = 0; f < k; ++f) {
        __m512i code = f ? _mm512_srli_epi16(words, f * BITS) : words;
        if constexpr (BITS < 8)
          if (f < k - 1) code = _mm512_and_si512(code, _mm512_set1_epi16((1 << BITS) - 1));
        const int32_t* wt = wp[f] + t * kMaxIntGroups;
        for (int r = 0; r < NB; ++r) a[r][f] = dpwssd_bcst(a[r][f], code, wt + r * kIntRow);
      }
    }
    for (int r = 0; r < NB; ++r)
      for (int f = 0; f < k; ++f) {
        float* x = acc + r * Dv + f * n + c;
        store16(x, load16(x) * splat(alpha[r]) + splat(z[r * kMaxValueGroups + gf[f]]) +
                       (v16)_mm512_cvtepi32_ps(a[r][f]) * splat(dq[r * vg + gf[f]]));
      }
  }
#elif defined(KVJAX_AVX2_INT)
  // AVX2: per token pair, the two rows' 16 bytes interleaved (vpunpck{l,h}bw) and widened
  // to words (vpmovzxbw): dword i holds channel i's codes of both tokens; each field masked
  // / shifted out, one vpmaddwd and vpaddd per 8 channels, field and query row. The int32
  // sums of FB fields of NB rows (2 ymm each) in registers, passes over the fields.
  constexpr int k = 8 / BITS;
  constexpr int FB = std::max(1, std::min(k, 4 / NB));  // fields per pass
  static_assert(NB <= 4, "chunk_accumulate gives at most 4 rows on AVX2");
  const int64_t Dv = DVT ? DVT : Dv_rt, n = Dv / k;
  const CodeRows<S>& geo = *ch.geo;
  const int64_t vw = geo.vw, vg = geo.vg;
  alignas(32) int32_t wq[NB * kIntRow];
  alignas(32) float dq[NB * kMaxIntGroups];
  float z[NB * kMaxValueGroups];
  int_value_weights<NB>(probs, ch, wq, dq, z);
  const __m256i mask = _mm256_set1_epi16((1 << BITS) - 1);
  for (int64_t c = 0; c < n; c += kLanes) {
    for (int f0 = 0; f0 < k; f0 += FB) {
      int64_t gf[FB];  // the value group of each field's 16 channels
      for (int f = 0; f < FB; ++f) gf[f] = geo.vec_group[((f0 + f) * n + c) / kLanes];
      __m256i a[NB][FB][2];
      for (int r = 0; r < NB; ++r)
        for (int f = 0; f < FB; ++f) a[r][f][0] = a[r][f][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int t = 0; t < kLanes / 2; ++t) {
        const uint8_t* row = ch.v + 2 * t * vw + c;
        const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
        const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + vw));
        const __m256i lo = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(r0, r1));
        const __m256i hi = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(r0, r1));
        for (int f = 0; f < FB; ++f) {
          const int sh = (f0 + f) * BITS;
          __m256i cl = sh ? _mm256_srli_epi16(lo, sh) : lo;
          __m256i chi = sh ? _mm256_srli_epi16(hi, sh) : hi;
          if constexpr (BITS < 8)
            if (f0 + f < k - 1) cl = _mm256_and_si256(cl, mask), chi = _mm256_and_si256(chi, mask);
          const int32_t* wt = wq + t * vg + gf[f];
          for (int r = 0; r < NB; ++r) {
            const __m256i wr = _mm256_set1_epi32(wt[r * kIntRow]);
            a[r][f][0] = _mm256_add_epi32(a[r][f][0], _mm256_madd_epi16(cl, wr));
            a[r][f][1] = _mm256_add_epi32(a[r][f][1], _mm256_madd_epi16(chi, wr));
          }
        }
      }
      for (int r = 0; r < NB; ++r)
        for (int f = 0; f < FB; ++f) {
          float* x = acc + r * Dv + (f0 + f) * n + c;
          const __m256 al = _mm256_set1_ps(alpha[r]);
          const __m256 zg = _mm256_set1_ps(z[r * kMaxValueGroups + gf[f]]);
          const __m256 d = _mm256_set1_ps(dq[r * kMaxIntGroups + gf[f]]);
          for (int u = 0; u < 2; ++u)
            _mm256_storeu_ps(x + 8 * u,
                             _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][f][u]), d,
                                             _mm256_fmadd_ps(_mm256_loadu_ps(x + 8 * u), al, zg)));
        }
    }
  }
#else
  (void)acc, (void)Dv_rt, (void)alpha, (void)probs, (void)ch;
#endif
}

// acc[r] = alpha[r] acc[r] + sum_j p[r][j] (s[j] code[j] + zero[j]) for rows [g0, g0 + NB)
// (natural order), one 16-byte column of codes (k vectors of channels) at a time with the
// rows' accumulators in registers; at most 16 accumulators per pass.
template <int NB, int DVT, int BITS, typename S>
inline void chunk_accumulate(float* acc, int64_t Dv_rt, const float* alpha, const float* probs,
                             const CodeChunk<BITS, S>& ch) {
  if (!ch.k) return chunk_accumulate<NB, DVT>(acc, Dv_rt, alpha, probs, *ch.rows);
  constexpr int k = 8 / BITS;
  const int64_t Dv = DVT ? DVT : Dv_rt, n = Dv / k;
  // Rows per pass: all k fields of NB rows in registers (one widening per 16 bytes serves
  // them all); where fewer accumulators fit (AVX2), passes over the fields instead.
  constexpr int RB = kAccVecs < 16 ? std::min(NB, kAccVecs)
                                   : (NB * k <= 16 ? NB : std::max(1, 16 / k));
  constexpr int FB = std::max(1, std::min(k, kAccVecs / RB));  // fields per pass
  if constexpr (RB < NB) {
    for (int r0 = 0; r0 < NB; r0 += RB)
      chunk_accumulate<RB, DVT>(acc + r0 * Dv, Dv, alpha + r0, probs + r0 * kLanes, ch);
    return;
  } else {
    const CodeRows<S>& geo = *ch.geo;
    if constexpr (kIntValues)
      if (geo.int_values) return int_accumulate<NB, DVT>(acc, Dv, alpha, probs, ch);
    const int64_t vw = geo.vw, vg = geo.vg, vgroup = geo.vgroup, m = kLanes * vg;
    alignas(64) float w[NB * kLanes * kMaxValueGroups];
    float z[NB * kMaxValueGroups];
    value_weights<NB>(probs, ch, w, z);
    for (int64_t c = 0; c < n; c += kLanes) {
      for (int f0 = 0; f0 < k; f0 += FB) {
        int64_t gf[FB];  // the value group of each field's 16 channels
        for (int f = 0; f < FB; ++f) gf[f] = ((f0 + f) * n + c) / vgroup;
        v16 x[NB][FB];
        for (int r = 0; r < NB; ++r)
          for (int f = 0; f < FB; ++f)
            x[r][f] = load16(acc + r * Dv + (f0 + f) * n + c) * splat(alpha[r]) +
                      splat(z[r * kMaxValueGroups + gf[f]]);
        for (int j = 0; j < kLanes; ++j) {
          const v16i b = widen_bytes(ch.v + j * vw + c);
          for (int f = 0; f < FB; ++f) {
            const v16 code = code_field<BITS>(b, f0 + f);
            for (int r = 0; r < NB; ++r) x[r][f] += splat(w[r * m + j * vg + gf[f]]) * code;
          }
        }
        for (int r = 0; r < NB; ++r)
          for (int f = 0; f < FB; ++f) store16(acc + r * Dv + (f0 + f) * n + c, x[r][f]);
      }
    }
  }
}

template <typename S, int DT, int DVT>
void quant_item(const QuantArgs& a, int64_t b, int64_t h) {
  const int64_t G = a.group, D = a.head_dim, Dv = a.v_head_dim, ps = a.page_size;
  const int64_t Dp = round16(D), Dvp = round16(Dv);
  float* out = a.out + (b * a.q_heads + h * G) * Dv;
  float* lse = a.lse + b * a.q_heads + h * G;

  const int64_t pos = a.q_pos[b];
  // Positions below Q are in pages, [Q, Q + ring) in the tail ring.
  const int64_t Q = std::min<int64_t>(a.quant_lengths[b], a.max_pages * ps);
  const int64_t hi = std::min<int64_t>({a.lengths[b], pos + 1, Q + a.ring});
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos + 1 - a.window) : 0;
  const int64_t qhi = std::min(hi, Q);  // the pages' part ends here
  const int64_t batch = a.tail_batch;
  if (pos < 0 || lo >= hi) {
    std::fill(out, out + G * Dv, 0.0f);
    std::fill(lse, lse + G, kNegInf);
    return;
  }

  std::vector<float> scratch(G * Dp + G * Dvp + kLanes * (Dp + 2 * Dvp) + G * kLanes + 2 * Dp +
                             2 * G * Dp + G + 2 * Dvp);
  float* qs = scratch.data();
  float* acc = qs + G * Dp;
  float* kbuf = acc + G * Dvp;
  // Two value buffers, used in turn: attend_rows accumulates a chunk's values after the
  // next chunk is loaded (its keys are done by then, so one key buffer serves).
  float* vbufs[2] = {kbuf + kLanes * Dp, kbuf + kLanes * Dp + kLanes * Dvp};
  int vturn = 0;
  float* vbuf = vbufs[0];
  float* probs = vbufs[1] + kLanes * Dvp;
  float* kscale = probs + G * kLanes;  // the current key scale/zero row as float32
  float* kzero = kscale + Dp;
  float* qfold = kzero + Dp;  // the query rows times the current key group's scales
  float* qbias = qfold + G * Dp;  // and their dot products with its zeros
  float* vsz = qbias + G;  // one value row's scales and zeros as float32
  float* qint = vsz + 2 * Dvp;  // qfold as 16-bit integers (int_query_row)
  int32_t vec_group[kMaxGroup];  // value scale group of each 16-channel vector
  for (int64_t g = 0; g < G; ++g) {
    const float* qr = a.q + (b * a.q_heads + h * G + g) * D;
    for (int64_t d = 0; d < Dp; ++d) qs[g * Dp + d] = d < D ? qr[d] * a.scale : 0.0f;
  }

  const int64_t kw = D * a.k_bits / 8, vw = Dv * a.v_bits / 8;  // bytes per row
  const int64_t head = (a.layer * a.kv_heads + h) * a.pages;    // first page of this head
  const uint8_t* kc = a.kc + head * ps * kw;
  const uint8_t* vc = a.vc + head * ps * vw;
  const S* ks = static_cast<const S*>(a.ks) + head * a.k_srows * D;
  const S* kz = static_cast<const S*>(a.kz) + head * a.k_srows * D;
  const S* vs = static_cast<const S*>(a.vs) + head * ps * a.v_groups;
  const S* vz = static_cast<const S*>(a.vz) + head * ps * a.v_groups;
  const int64_t k_group = ps / a.k_srows, v_group = Dv / a.v_groups;
  const int32_t* table = a.tables + b * a.max_pages;
  const S* loaded = nullptr;  // key scale row currently in kscale/kzero
  const S* folded = nullptr;  // key scale row currently folded into qfold/qbias

  auto page_slot = [&](int64_t p) {  // (page, slot) of a position below Q
    if (a.max_pages == 0) return std::pair<int64_t, int64_t>(0, 0);
    // Masked lanes read a visible row; tail chunks compute this too and do not use it.
    p = std::max<int64_t>(std::min(std::max(p, lo), qhi - 1), 0);
    const int64_t page = std::min<int64_t>(p / ps, a.max_pages - 1);
    return std::pair<int64_t, int64_t>(clamp_index(table[page], a.pages), p % ps);
  };
  // The vectorised row dequantizer when the shapes allow it (same bits for K and V, each
  // field a whole number of 16-channel vectors, value groups of whole vectors).
  const bool vec = a.k_bits == a.v_bits && (D / (8 / a.k_bits)) % kLanes == 0 &&
                   (Dv / (8 / a.v_bits)) % kLanes == 0 && v_group % kLanes == 0;
  // Pages of whole 16-token chunks: a chunk inside [lo, hi) is 16 consecutive rows of one
  // page, found with one table lookup (integer divisions per token cost as much as the
  // dequantization of a row).
  const bool whole = ps % kLanes == 0;
  // A full chunk lies in one key group when groups are whole chunks: then the group's
  // scales fold into the query (q . (s * c + z) = (q * s) . c + q . z) and a code costs a
  // convert, not a convert, a multiply-add and two loads.
  const bool fold = vec && whole && k_group % kLanes == 0 && Dvp / kLanes <= kMaxGroup;
  if (fold)
    for (int64_t i = 0; i < Dvp / kLanes; ++i)
      vec_group[i] = static_cast<int32_t>(i * kLanes / v_group);
  // Whole chunks read in place by attend_rows (below).
  const bool in_place = fold && D % (2 * kLanes) == 0 && Dv % (2 * kLanes) == 0 &&
                        a.v_groups <= kMaxValueGroups && a.tuning.rows;
  // Their logits in 16-bit integers (int_query_row) where each field is whole 32-byte
  // blocks and the int32 sums cannot overflow: 32767 * (2^bits - 1) * D < 2^31.
  const bool int_logits = kIntLogits && a.tuning.int_logits && in_place &&
                          (D / (8 / a.k_bits)) % (2 * kLanes) == 0 &&
                          32767.0 * ((1 << a.k_bits) - 1) * D < 2147483648.0;
  // Their values in 16-bit integers (int_value_weights) where the groups per row are a
  // power of two up to 8 (a token pair's weights one dword after one in-block permute).
  const bool int_values = kIntValues && a.tuning.int_values && in_place &&
                          a.v_groups <= kMaxIntGroups && (a.v_groups & (a.v_groups - 1)) == 0;
  // Whole chunks of pages (16 rows of one page): the table looked up once, scales folded.
  auto fast_chunk = [&](int64_t c0) { return whole && c0 >= lo && c0 + kLanes <= qhi; };
  // One tail row (position p >= Q) widened to float32 rows of the chunk buffers.
  const int64_t tail_row0 = (h * batch + b) * a.ring;
  auto tail_row = [&](int64_t p, float* kd, float* vd) {
    const int64_t r = tail_row0 + p % a.ring;
    switch (a.tail_type) {
      case ffi::F32:
        to_f32(static_cast<const float*>(a.tk) + r * D, D, Dp, kd);
        to_f32(static_cast<const float*>(a.tv) + r * Dv, Dv, Dvp, vd);
        break;
      case ffi::BF16:
        to_f32(static_cast<const Bf16*>(a.tk) + r * D, D, Dp, kd);
        to_f32(static_cast<const Bf16*>(a.tv) + r * Dv, Dv, Dvp, vd);
        break;
      default:
        to_f32(static_cast<const Half*>(a.tk) + r * D, D, Dp, kd);
        to_f32(static_cast<const Half*>(a.tv) + r * Dv, Dv, Dvp, vd);
    }
  };
  // Folds the key scale row srow (a group's scales and zeros) into the query rows.
  auto refold = [&](const S* srow) {
    if (srow == folded) return;
    to_f32(srow, D, Dp, kscale);
    to_f32(kz + (srow - ks), D, Dp, kzero);
    fold_rows<DT>(qs, G, Dp, kscale, kzero, qfold, int_logits ? qint : nullptr, qbias);
    folded = srow;
    loaded = srow;  // kscale/kzero hold this row's scales as the unfolded path wants
  };
  // The chunk of positions [c0, c0 + 16) unpacked and dequantized into float32 rows.
  auto stage = [&](int64_t c0) -> Chunk {
    vbuf = vbufs[vturn];
    vturn ^= 1;
    const bool fast = fast_chunk(c0);
    const auto [page0, slot0] = page_slot(c0);
    if (fold && fast) {
      refold(ks + (page0 * a.k_srows + slot0 / k_group) * D);
      for (int j = 0; j < kLanes; ++j) {
        const int64_t row = page0 * ps + slot0 + j;
        const uint8_t* kr = kc + row * kw;
        const uint8_t* vr = vc + row * vw;
        const int64_t vrow = row * a.v_groups;
        float* kd = kbuf + j * Dp;
        float* vd = vbuf + j * Dvp;
        if (a.k_bits == 8) {
          key_codes16<8>(kr, D, kd);
          value_row16<8>(vr, vs + vrow, vz + vrow, vec_group, Dv, vsz, a.v_groups, vd);
        } else if (a.k_bits == 4) {
          key_codes16<4>(kr, D, kd);
          value_row16<4>(vr, vs + vrow, vz + vrow, vec_group, Dv, vsz, a.v_groups, vd);
        } else {
          key_codes16<2>(kr, D, kd);
          value_row16<2>(vr, vs + vrow, vz + vrow, vec_group, Dv, vsz, a.v_groups, vd);
        }
      }
      return {kbuf, Dp, vbuf, Dvp, qfold, qbias};
    }
    for (int j = 0; j < kLanes; ++j) {
      const int64_t p = std::min(std::max(c0 + j, lo), hi - 1);  // masked lanes: a visible row
      if (p >= Q) {
        tail_row(p, kbuf + j * Dp, vbuf + j * Dvp);
        continue;
      }
      const auto [page, slot] = fast ? std::pair<int64_t, int64_t>(page0, slot0 + j)
                                     : page_slot(c0 + j);
      const int64_t srow_index = fast && k_group % kLanes == 0 ? slot0 / k_group
                                                                : slot / k_group;
      const S* srow = ks + (page * a.k_srows + srow_index) * D;
      if (srow != loaded) {  // a key group's scales serve its G tokens: convert once
        to_f32(srow, D, Dp, kscale);
        to_f32(kz + (srow - ks), D, Dp, kzero);
        loaded = srow;
      }
      const uint8_t* kr = kc + (page * ps + slot) * kw;
      const uint8_t* vr = vc + (page * ps + slot) * vw;
      const int64_t vrow = (page * ps + slot) * a.v_groups;
      float* kd = kbuf + j * Dp;
      float* vd = vbuf + j * Dvp;
      if (vec) {
        if (a.k_bits == 8) {
          dequant_rows16<8>(kr, kscale, kzero, D, vr, vs + vrow, vz + vrow, v_group, Dv, kd, vd);
        } else if (a.k_bits == 4) {
          dequant_rows16<4>(kr, kscale, kzero, D, vr, vs + vrow, vz + vrow, v_group, Dv, kd, vd);
        } else {
          dequant_rows16<2>(kr, kscale, kzero, D, vr, vs + vrow, vz + vrow, v_group, Dv, kd, vd);
        }
      } else {
        dequant_key_row(kr, D, a.k_bits, kscale, kzero, Dp, kd);
        dequant_value_row(vr, Dv, a.v_bits, vs + vrow, vz + vrow, v_group, Dvp, vd);
      }
    }
    return {kbuf, Dp, vbuf, Dvp};
  };
  auto prefetch = [&](int64_t c0) {
    if (c0 >= qhi) {
      // The tail ring's rows: all but the newest were written in earlier steps, and a
      // whole decode step (every layer) has run since, so they are out of cache too.
      const int64_t bytes = a.tail_type == ffi::F32 ? 4 : 2;
      for (int64_t p = std::max(c0, lo); p < std::min(c0 + kLanes, hi); ++p) {
        const int64_t r = tail_row0 + p % a.ring;
        prefetch_row(static_cast<const char*>(a.tk) + r * D * bytes, D * bytes);
        prefetch_row(static_cast<const char*>(a.tv) + r * Dv * bytes, Dv * bytes);
      }
      return;
    }
    const auto [page, slot] = page_slot(c0);
    const int64_t rows = std::min<int64_t>(kLanes, ps - slot);
    prefetch_bytes(kc + (page * ps + slot) * kw, rows * kw);
    prefetch_bytes(vc + (page * ps + slot) * vw, rows * vw);
    prefetch_bytes(vs + (page * ps + slot) * a.v_groups, rows * a.v_groups * sizeof(S));
    prefetch_bytes(vz + (page * ps + slot) * a.v_groups, rows * a.v_groups * sizeof(S));
  };
  if (in_place) {
    // Whole chunks: codes read in place by the register-blocked core (query rows in
    // register blocks, each unpacked key/value vector used by 4-8 of them), a later
    // chunk's rows prefetched one per token step (locate); the edges of [lo, hi) and
    // the tail come as float32 rows (stage) and are hinted at once.
    CodeRows<S> geo;
    geo.kw = kw;
    geo.vw = vw;
    geo.vg = a.v_groups;
    geo.vgroup = v_group;
    geo.kbytes = D * sizeof(S);
    geo.vbytes = kLanes * a.v_groups * sizeof(S);
    geo.kz = kz - ks;
    geo.int_logits = int_logits;
    geo.qstride = Dp;
    geo.int_values = int_values;
    geo.vec_group = vec_group;
    if (int_values) {
      // Output zmm zi of a block pair: lane q is token pair 2 zi + q / 16, group (q % 16) / 2,
      // token (q % 2) of the pair, read from packed lane 8 (i / 4) + 4 (u / 16) + i % 4
      // (vpackssdw interleaves the two blocks by 128-bit lanes; u: the w lane, i = u % 16).
      const int64_t vg = a.v_groups;
      for (int zi = 0; zi < 4; ++zi)
        for (int q = 0; q < 2 * kLanes; ++q) {
          const int64_t g = q % kLanes / 2, j = 2 * (2 * zi + q / kLanes) + q % 2;
          const int64_t u = (j * vg + g) % (2 * kLanes), i = u % kLanes;
          geo.out_index[zi][q] = static_cast<int16_t>(8 * (i / 4) + 4 * (u / kLanes) + i % 4);
          if (zi == 0 && g < vg) geo.pad_mask |= 1u << q;
        }
      for (int o = 0; o < kLanes; ++o) geo.lane_group[o] = static_cast<int32_t>(o % vg);
    }
    geo.vz = vz - vs;
    Chunk staged[2];  // the staged chunks' rows (two live at a time, as the value buffers)
    auto run = [&](auto bits) {
      using Codes = CodeChunk<decltype(bits)::value, S>;
      auto in_place = [&](int64_t c0) {
        Codes ch;
        const auto [page, slot] = page_slot(c0);
        const int64_t row = page * ps + slot;
        ch.k = kc + row * kw;
        ch.v = vc + row * vw;
        ch.vs = vs + row * a.v_groups;
        ch.ks = ks + (page * a.k_srows + slot / k_group) * D;
        ch.geo = &geo;
        ch.q = int_logits ? qint : qfold;
        ch.bias = qbias;
        return ch;
      };
      auto load = [&](int64_t c0) {
        if (!fast_chunk(c0)) {
          const int turn = vturn;  // stage() takes this turn's value buffer
          staged[turn] = stage(c0);
          Codes ch;
          ch.rows = &staged[turn];
          ch.q = staged[turn].q;
          ch.bias = staged[turn].bias;
          return ch;
        }
        const Codes ch = in_place(c0);
        refold(ch.ks);
        return ch;
      };
      auto locate = [&](int64_t c0) { return fast_chunk(c0) ? in_place(c0) : Codes{}; };
      attend_rows<Codes, DT, DVT>(a.tuning, qs, G, D, Dv, lo, hi, a.soft_cap, load, prefetch, locate, out,
                                  lse);
    };
    if (a.k_bits == 8) {
      run(std::integral_constant<int, 8>{});
    } else if (a.k_bits == 4) {
      run(std::integral_constant<int, 4>{});
    } else {
      run(std::integral_constant<int, 2>{});
    }
    return;
  }
  attend<DT, DVT>(a.tuning, qs, G, Dp, Dvp, Dv, lo, hi, a.soft_cap, stage, prefetch, acc, probs,
                  out, lse);
}

}  // namespace

template <typename S>
void quant_dispatch(const QuantArgs& a, int64_t b, int64_t h) {
  if (a.head_dim == 128 && a.v_head_dim == 128) return quant_item<S, 128, 128>(a, b, h);
  if (a.head_dim == 64 && a.v_head_dim == 64) return quant_item<S, 64, 64>(a, b, h);
  return quant_item<S, 0, 0>(a, b, h);
}

}  // namespace kvjax
