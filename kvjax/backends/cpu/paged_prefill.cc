// Paged chunked-prefill attention on CPU: flash attention over the pages, causal.
//
// Work item = (sequence b, KV head h, block of query positions). The item's rows are its
// (query position, query head in the group) pairs, scaled and packed once; it walks the
// keys its rows can see, kBlockKeys at a time, and never a key past its last query:
// causal blocks above the diagonal are skipped, not masked (the XLA path computes them
// and selects them away). Per key block: the keys are gathered through the block table
// and transposed into [head_dim][kBlockKeys] (bf16 / f16 widened), the values into
// [kBlockKeys][v_head_dim]; the logits come from a register block of query rows x key
// vectors (query elements broadcast, keys along the lanes), the online softmax folds them
// into each row's (max, sum) and rescales its accumulator, and the values are added by a
// register block of rows x output vectors. Register blocks use the target's own vector
// width (native.h): 6 rows x 4 zmm on AVX-512, 6 rows x 2 ymm on AVX2. bfloat16 queries on
// bfloat16 pages (an even head_dim, a build with AVX512_BF16) take their logits on
// vdpbf16ps instead: the keys' element pairs transposed as 32-bit words, unwidened, and
// two products per lane and instruction (logits_block_pairs).
//
// Semantics are kernels_pallas/paged_attention/reference.py's prefill: query t of row b
// (t < q_lengths[b]) sits at position lengths[b] - q_lengths[b] + t and sees key positions
// k <= its position, k < min(lengths[b], max_pages * page_size), and position - k < window
// when a window is set; padding queries and rows that see nothing return 0 and lse -inf.
// Only keys some query of the item sees are read, so a non-finite value in a page or row
// no query sees cannot reach an output. Table entries are clamped into the pool.

#include "native.h"

namespace kvjax {
namespace {

#if KVJAX_NAT == 16
constexpr int kRowBlock = 6;  // query rows per register block
constexpr int kKeyVecs = 4;   // key vectors per logits block: 6 x 4 + 4 + 1 of 32 zmm
constexpr int kOutVecs = 4;   // output vectors per values block
#elif KVJAX_NAT == 8
constexpr int kRowBlock = 6;  // 6 x 2 + 2 + 1 of 16 ymm
constexpr int kKeyVecs = 2;
constexpr int kOutVecs = 2;
#else
constexpr int kRowBlock = 4;
constexpr int kKeyVecs = 2;
constexpr int kOutVecs = 2;
#endif
constexpr int kBlockKeys = 64;  // a multiple of kKeyVecs * kNat and of kLanes

struct PrefillArgs {
  const float* q;  // [batch, q_len, q_heads, head_dim]
  const void* k;   // [layers, kv_heads, pages, page_size, head_dim] (f32, bf16 or f16)
  const void* v;   // [layers, kv_heads, pages, page_size, v_head_dim]
  int64_t layer, kv_heads, pages, page_size, head_dim, v_head_dim, q_heads, group;
  int64_t batch, q_len, positions;  // positions: query positions per work item
  const int32_t* lengths;    // [batch]
  const int32_t* tables;     // [batch, max_pages]
  const int32_t* q_lengths;  // [batch]
  int64_t max_pages;
  float scale, soft_cap;  // soft_cap <= 0: none
  int64_t window;         // <= 0: none
  float* out;             // [batch, q_len, q_heads, v_head_dim]
  float* lse;             // [batch, q_len, q_heads]
  bool q_bf16;            // q's values are bfloat16 (widened): the pairs path may take it
};

// s[m][j0 + ...] = q[m] . key j for rows [0, MR) and kKeyVecs vectors of keys from j0;
// q rows of D elements, keys transposed in kt [D][kBlockKeys].
template <int MR>
inline void logits_block(const float* __restrict q, int64_t D, const float* __restrict kt,
                         int64_t j0, float* __restrict s) {
  vn acc[MR][kKeyVecs];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < kKeyVecs; ++v) acc[m][v] = vn{};
  for (int64_t d = 0; d < D; ++d) {
    vn kv[kKeyVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kKeyVecs; ++v) kv[v] = loadn(kt + d * kBlockKeys + j0 + v * kNat);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const vn qb = broadcast(q + m * D + d);
#pragma GCC unroll 4
      for (int v = 0; v < kKeyVecs; ++v) acc[m][v] += qb * kv[v];
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < kKeyVecs; ++v) storen(s + m * kBlockKeys + j0 + v * kNat, acc[m][v]);
}

// o[m][c0 + ...] += sum_j p[m][j] vb[j][c0 + ...] for rows [0, MR), NV output vectors
// from c0, keys j < nk; o rows of Dvp elements, values in vb [kBlockKeys][Dvp].
template <int MR, int NV>
inline void values_block(const float* __restrict p, const float* __restrict vb, int64_t Dvp,
                         int64_t c0, int64_t nk, float* __restrict o) {
  vn acc[MR][NV];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[m][v] = loadn(o + m * Dvp + c0 + v * kNat);
  for (int64_t j = 0; j < nk; ++j) {
    vn vv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vv[v] = loadn(vb + j * Dvp + c0 + v * kNat);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const vn pb = broadcast(p + m * kBlockKeys + j);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[m][v] += pb * vv[v];
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) storen(o + m * Dvp + c0 + v * kNat, acc[m][v]);
}

template <int MR>
inline void values_any(const float* p, const float* vb, int64_t Dvp, int64_t nk, float* o) {
  int64_t c0 = 0;
  for (; c0 + kOutVecs * kNat <= Dvp; c0 += kOutVecs * kNat)
    values_block<MR, kOutVecs>(p, vb, Dvp, c0, nk, o);
  for (; c0 < Dvp; c0 += kNat) values_block<MR, 1>(p, vb, Dvp, c0, nk, o);
}

// x rounded to bfloat16 (to nearest, ties to even; NaN stays NaN): its bits. Exact for a
// widened bfloat16; XLA may hand a bfloat16 program's values over in float32 with more
// precision than bfloat16 holds (excess precision), which this rounds as a convert would.
inline uint32_t bf16_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (b >> 16) | 0x40u;
  return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

#if defined(__AVX512BF16__) && KVJAX_NAT == 16
#define KVJAX_PREFILL_PAIRS 1
// The logits of bfloat16 queries and keys on vdpbf16ps: q rows of P = head_dim / 2 words,
// word p holding the row's elements 2p and 2p + 1; keys in kt [P][kBlockKeys], word (p, j)
// key j's elements 2p and 2p + 1. One instruction adds both products of a pair (exact in
// float32) to a key's sum: half the multiply-adds of the float32 block, and half its key
// block's transposed words.
template <int MR>
inline void logits_block_pairs(const uint32_t* __restrict q, int64_t P,
                               const uint32_t* __restrict kt, int64_t j0, float* __restrict s) {
  __m512 acc[MR][kKeyVecs];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < kKeyVecs; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512bh kv[kKeyVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kKeyVecs; ++v)
      kv[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kt + p * kBlockKeys + j0 + v * kNat));
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512bh qb =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(q[m * P + p])));
#pragma GCC unroll 4
      for (int v = 0; v < kKeyVecs; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], qb, kv[v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < kKeyVecs; ++v) _mm512_storeu_ps(s + m * kBlockKeys + j0 + v * kNat, acc[m][v]);
}
#endif

// Flash attention of one work item's R query rows over the keys [lo, hi) the rows can see,
// kBlockKeys at a time. q_row(r): row r's query (head_dim floats, unscaled); pos_of(r): its
// position (< 0: a padding row, which sees nothing); fill(k0, nk, kt, vb): the keys of
// positions [k0, k0 + nk) transposed into kt [D][kBlockKeys] and their values into
// vb [kBlockKeys][Dvp], both widened to float32 and zero past nk (and past Dv); store(r, o,
// lse): row r's normalised output (Dv floats; zeros and lse -inf for a row that saw
// nothing). Row r sees the keys k in [lo, hi) with k <= pos_of(r) and, with a window,
// pos_of(r) - k < window. When `sorted` (the rows' positions never decrease), rows that
// end below a key block skip it. With `Pairs` (bfloat16 queries and keys, an even
// head_dim), the queries are rounded to bfloat16, their program's dtype (`bf16_bits`), and
// `fill` writes kt as logits_block_pairs' words ([D / 2][kBlockKeys] uint32); the scale
// then multiplies the logits instead of the queries.
template <bool Pairs = false, typename QRow, typename PosOf, typename Fill, typename Store>
void flash_rows(int64_t R, int64_t D, int64_t Dv, float scale, float soft_cap, int64_t window,
                int64_t lo, int64_t hi, bool sorted, QRow q_row, PosOf pos_of, Fill fill,
                Store store) {
  const int64_t Dvp = (Dv + kNat - 1) / kNat * kNat;
  const int64_t Rp = (R + kRowBlock - 1) / kRowBlock * kRowBlock;
  thread_local Scratch buf;
  float* qs = buf.get(Rp * D + D * kBlockKeys + kBlockKeys * Dvp + Rp * kBlockKeys + Rp * Dvp +
                      2 * Rp);
  float* kt = qs + Rp * D;
  float* vb = kt + D * kBlockKeys;
  float* s = vb + kBlockKeys * Dvp;
  float* o = s + Rp * kBlockKeys;
  float* mx = o + Rp * Dvp;
  float* sum = mx + Rp;
  [[maybe_unused]] uint32_t* qp = reinterpret_cast<uint32_t*>(qs);  // Pairs: [Rp][D / 2] words
  for (int64_t r = 0; r < Rp; ++r) {
    float* dst = qs + r * D;
    if constexpr (Pairs) {
      uint32_t* words = qp + r * (D / 2);
      if (r < R) {
        const float* src = q_row(r);
        for (int64_t p = 0; p < D / 2; ++p)
          words[p] = bf16_bits(src[2 * p]) | (bf16_bits(src[2 * p + 1]) << 16);
      } else {
        std::fill(words, words + D / 2, 0u);
      }
    } else if (r < R) {
      const float* src = q_row(r);
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
    } else {
      std::fill(dst, dst + D, 0.0f);
    }
  }
  std::fill(o, o + Rp * Dvp, 0.0f);
  std::fill(mx, mx + Rp, kNegInf);
  std::fill(sum, sum + Rp, 0.0f);

  const float cap = soft_cap;
  const v16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t k0 = lo; k0 < hi; k0 += kBlockKeys) {
    const int64_t nk = std::min<int64_t>(kBlockKeys, hi - k0);
    fill(k0, nk, kt, vb, Dvp);
    // Rows whose position is below k0 see nothing here (causal): with sorted rows only
    // the rows from the first that reaches k0 take part.
    int64_t first = 0;
    if (sorted)
      while (first < R && pos_of(first) < k0) ++first;
    const int64_t r_first = first / kRowBlock * kRowBlock;
    const int64_t kv_end = (nk + kKeyVecs * kNat - 1) / (kKeyVecs * kNat) * (kKeyVecs * kNat);
    for (int64_t r = r_first; r < Rp; r += kRowBlock)
      for (int64_t j0 = 0; j0 < kv_end; j0 += kKeyVecs * kNat) {
#ifdef KVJAX_PREFILL_PAIRS
        if constexpr (Pairs) {
          logits_block_pairs<kRowBlock>(qp + r * (D / 2), D / 2,
                                        reinterpret_cast<const uint32_t*>(kt), j0,
                                        s + r * kBlockKeys);
          continue;
        }
#endif
        logits_block<kRowBlock>(qs + r * D, D, kt, j0, s + r * kBlockKeys);
      }
    for (int64_t r = r_first; r < R; ++r) {
      float* sr = s + r * kBlockKeys;
      const int64_t pos = pos_of(r);
      const int64_t vis_lo = std::max<int64_t>(window > 0 ? pos - window + 1 : 0, k0) - k0;
      const int64_t vis_hi = std::min<int64_t>(pos + 1, k0 + nk) - k0;  // keys [vis_lo, vis_hi)
      if (pos < 0 || vis_lo >= vis_hi) {
        std::fill(sr, sr + kBlockKeys, 0.0f);
        continue;
      }
      // Keys outside [vis_lo, vis_hi) are selected away (-inf), never weighted by 0.
      v16 x[kBlockKeys / kLanes];
      v16 top = splat(kNegInf);
      for (int c = 0; c < kBlockKeys / kLanes; ++c) {
        x[c] = load16(sr + c * kLanes);
        if constexpr (Pairs) x[c] *= scale;
        if (cap > 0.0f) x[c] = cap * vtanh(x[c] / cap);
        const v16 at = iota + static_cast<float>(c * kLanes);
        const v16i vis = ge(at, splat(static_cast<float>(vis_lo))) &
                         lt(at, splat(static_cast<float>(vis_hi)));
        x[c] = select(vis, x[c], splat(kNegInf));
        top = vmax(top, x[c]);
      }
      const float m_new = std::max(mx[r], hmax(top));  // finite: a key is visible
      const float alpha = std::exp(mx[r] - m_new);      // 0 when nothing was seen before
      v16 add = v16{};
      for (int c = 0; c < kBlockKeys / kLanes; ++c) {
        const v16 p = vexp(x[c] - splat(m_new));  // exp(-inf) = 0
        store16(sr + c * kLanes, p);
        add += p;
      }
      sum[r] = sum[r] * alpha + hsum(add);
      mx[r] = m_new;
      if (alpha != 1.0f) {
        float* orow = o + r * Dvp;
        for (int64_t d = 0; d < Dvp; ++d) orow[d] *= alpha;
      }
    }
    for (int64_t r = R; r < Rp; ++r) std::fill(s + r * kBlockKeys, s + (r + 1) * kBlockKeys, 0.0f);
    for (int64_t r = r_first; r < Rp; r += kRowBlock)
      values_any<kRowBlock>(s + r * kBlockKeys, vb, Dvp, nk, o + r * Dvp);
  }
  for (int64_t r = 0; r < R; ++r) {
    if (sum[r] > 0.0f) {
      const float inv = 1.0f / sum[r];
      for (int64_t d = 0; d < Dv; ++d) o[r * Dvp + d] *= inv;
      store(r, o + r * Dvp, mx[r] + std::log(sum[r]));
    } else {
      std::fill(o + r * Dvp, o + r * Dvp + Dv, 0.0f);
      store(r, o + r * Dvp, kNegInf);
    }
  }
}

template <typename T>
void prefill_item(const PrefillArgs& a, int64_t b, int64_t h, int64_t t0) {
  const int64_t G = a.group, D = a.head_dim, Dv = a.v_head_dim, ps = a.page_size;
  const int64_t qlen = std::min<int64_t>(std::max<int32_t>(a.q_lengths[b], 0), a.q_len);
  const int64_t nt = std::min<int64_t>(a.positions, a.q_len - t0);  // positions of the item
  const int64_t live = std::max<int64_t>(0, std::min(nt, qlen - t0));  // real queries
  const int64_t len = a.lengths[b];
  const int64_t pos0 = len - qlen + t0;  // position of query t0
  const int64_t hi = std::min({len, a.max_pages * ps, pos0 + live});  // keys < hi
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos0 - a.window + 1) : 0;
  const int64_t R = live * G;  // row r: position t0 + r / G, head h * G + r % G
  auto row_index = [&](int64_t r) { return (b * a.q_len + t0 + r / G) * a.q_heads + h * G + r % G; };
  auto store = [&](int64_t r, const float* o, float lse) {
    std::copy(o, o + Dv, a.out + row_index(r) * Dv);
    a.lse[row_index(r)] = lse;
  };
  for (int64_t r = R; r < nt * G; ++r) {  // padding queries
    std::fill(a.out + row_index(r) * Dv, a.out + (row_index(r) + 1) * Dv, 0.0f);
    a.lse[row_index(r)] = kNegInf;
  }
  if (R == 0) return;
  const T* kbase = static_cast<const T*>(a.k) + (a.layer * a.kv_heads + h) * a.pages * ps * D;
  const T* vbase = static_cast<const T*>(a.v) + (a.layer * a.kv_heads + h) * a.pages * ps * Dv;
  const int32_t* table = a.tables + b * a.max_pages;
  // The pairs path (below) takes the keys as 32-bit words of two bfloat16 elements.
  [[maybe_unused]] bool pairs = false;
#ifdef KVJAX_PREFILL_PAIRS
  if constexpr (std::is_same_v<T, Bf16>) pairs = a.q_bf16 && D % 2 == 0;
#endif
  auto fill = [&](int64_t k0, int64_t nk, float* kt, float* vb, int64_t Dvp) {
    uint32_t* kw = reinterpret_cast<uint32_t*>(kt);  // pairs: [D / 2][kBlockKeys] words
    for (int64_t j = 0; j < kBlockKeys; ++j) {
      if (j < nk) {
        const int64_t pos = k0 + j;
        const int64_t row = clamp_index(table[pos / ps], a.pages) * ps + pos % ps;
        const T* kr = kbase + row * D;
        const T* vr = vbase + row * Dv;
        if (pairs) {
          for (int64_t p = 0; p < D / 2; ++p) std::memcpy(kw + p * kBlockKeys + j, kr + 2 * p, 4);
        } else {
          for (int64_t d = 0; d < D; ++d) kt[d * kBlockKeys + j] = to_float(kr[d]);
        }
        float* vd = vb + j * Dvp;
        for (int64_t d = 0; d < Dv; ++d) vd[d] = to_float(vr[d]);
        std::fill(vd + Dv, vd + Dvp, 0.0f);
      } else {
        for (int64_t d = 0; d < (pairs ? D / 2 : D); ++d) kw[d * kBlockKeys + j] = 0u;
        std::fill(vb + j * Dvp, vb + (j + 1) * Dvp, 0.0f);
      }
    }
  };
  auto q_row = [&](int64_t r) { return a.q + row_index(r) * D; };
  auto pos_of = [&](int64_t r) { return pos0 + r / G; };
#ifdef KVJAX_PREFILL_PAIRS
  if constexpr (std::is_same_v<T, Bf16>) {
    if (pairs) {
      flash_rows<true>(R, D, Dv, a.scale, a.soft_cap, a.window, lo, hi, /*sorted=*/true, q_row,
                       pos_of, fill, store);
      return;
    }
  }
#endif
  flash_rows(R, D, Dv, a.scale, a.soft_cap, a.window, lo, hi, /*sorted=*/true, q_row, pos_of,
             fill, store);
}

ffi::Error PagedPrefillImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> tables,
                            ffi::Buffer<ffi::S32> q_lengths, float scale, float soft_cap,
                            int64_t window, int64_t item_rows, int64_t q_bf16,
                            ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument(
        "kvjax paged prefill: expected q [batch, q_len, q_heads, head_dim], pools [layers, "
        "kv_heads, pages, page_size, width], tables [batch, max_pages]");
  const auto dt = k.element_type();
  if (v.element_type() != dt || (dt != ffi::F32 && dt != ffi::BF16 && dt != ffi::F16))
    return ffi::Error::InvalidArgument("kvjax paged prefill: pools must both be f32, bf16 or f16");
  PrefillArgs a;
  a.batch = qd[0];
  a.q_len = qd[1];
  a.q_heads = qd[2];
  a.q = q.typed_data();
  a.k = k.untyped_data();
  a.v = v.untyped_data();
  a.kv_heads = kd[1];
  a.pages = kd[2];
  a.page_size = kd[3];
  a.head_dim = kd[4];
  a.v_head_dim = vd[4];
  if (a.kv_heads <= 0 || a.q_heads % a.kv_heads || qd[3] != a.head_dim || vd[0] != kd[0] ||
      vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3] || td[0] != a.batch ||
      lengths.element_count() != static_cast<size_t>(a.batch) ||
      q_lengths.element_count() != static_cast<size_t>(a.batch) || a.page_size <= 0)
    return ffi::Error::InvalidArgument("kvjax paged prefill: inconsistent shapes");
  a.group = a.q_heads / a.kv_heads;
  a.layer = clamp_index(layer.typed_data()[0], kd[0]);
  a.lengths = lengths.typed_data();
  a.tables = tables.typed_data();
  a.q_lengths = q_lengths.typed_data();
  a.max_pages = td[1];
  a.scale = scale;
  a.soft_cap = soft_cap;
  a.window = window;
  a.out = out->typed_data();
  a.lse = lse->typed_data();
  a.q_bf16 = q_bf16 != 0;
  if (a.batch == 0 || a.q_len == 0 || a.q_heads == 0) return ffi::Error::Success();
  // Query positions per work item: about `item_rows` rows (a multiple of the group).
  a.positions = std::max<int64_t>(1, (std::max<int64_t>(item_rows, 1) + a.group - 1) / a.group);
  const int64_t blocks = (a.q_len + a.positions - 1) / a.positions;
  const int64_t kvh = a.kv_heads;
  // The last query blocks see the most keys: hand them out first.
  parallel_for(&pool, a.batch * kvh * blocks, [&](int64_t i, int) {
    const int64_t blk = blocks - 1 - i / (a.batch * kvh), rest = i % (a.batch * kvh);
    const int64_t b = rest / kvh, h = rest % kvh, t0 = blk * a.positions;
    if (dt == ffi::BF16) {
      prefill_item<Bf16>(a, b, h, t0);
    } else if (dt == ffi::F16) {
      prefill_item<Half>(a, b, h, t0);
    } else {
      prefill_item<float>(a, b, h, t0);
    }
  });
  return ffi::Error::Success();
}

// ---- Chunked prefill over KIVI-quantized pages and their full-precision tail ----
//
// The semantics of kernels_pallas/quantized_attention/reference.py's quantized_attention
// for any q_len: query t of row b sits at q_pos[b, t] (< 0: padding, output 0 and lse
// -inf) and sees keys k < lengths[b] with k <= q_pos[b, t] (and q_pos - k < window): k <
// Q = quant_lengths[b] from the quantized pages, k in [Q, Q + ring) from slot k mod ring
// of the tail ring, in one online softmax. Each key block is dequantized once per work
// item (code * scale + zero, float32) into flash_rows' transposed key block and value
// block; the many query rows of an item share it, so the dequantization costs a small
// fraction of the block's dot products. Page layout as quantized_kernel.h's header says.

struct QuantPrefillArgs {
  const float* q;              // [batch, q_len, q_heads, head_dim]
  const uint8_t *kc, *vc;      // [layers, kv_heads, pages, page_size, width * bits / 8]
  const void *ks, *kz;         // [layers, kv_heads, pages, page_size / Gk, head_dim]
  const void *vs, *vz;         // [layers, kv_heads, pages, page_size, v_head_dim / Gv]
  const void *tk, *tv;         // [kv_heads, batch, ring, width]
  int64_t layer, kv_heads, pages, page_size, head_dim, v_head_dim, q_heads, group;
  int64_t k_bits, v_bits, k_srows, v_groups, ring;
  int64_t batch, q_len, positions;  // positions: query positions per work item
  const int32_t *quant_lengths, *lengths, *q_pos, *tables;
  int64_t max_pages;
  float scale, soft_cap;
  int64_t window;
  float* out;  // [batch, q_len, q_heads, v_head_dim]
  float* lse;  // [batch, q_len, q_heads]
};

// Dequantizes a code row (planar-packed: field f of byte c is channel f * width / k + c,
// k = 8 / bits) as dst[ch * stride] = code(ch) * scale(ch) + zero(ch), with
// scale(ch) = s[ch / per] (per: channels sharing one scale; 1 for keys' per-channel rows).
template <typename S>
inline void dequant_row(const uint8_t* __restrict row, int64_t width, int64_t bits,
                        const S* s, const S* z, int64_t per, float* __restrict dst,
                        int64_t stride) {
  const int64_t k = 8 / bits, n = width / k;
  const uint32_t mask = (1u << bits) - 1;
  for (int64_t f = 0; f < k; ++f) {
    const int shift = static_cast<int>(f * bits);
    if (per == 1) {
      for (int64_t c = 0; c < n; ++c)
        dst[(f * n + c) * stride] = static_cast<float>((row[c] >> shift) & mask) *
                                        to_float(s[f * n + c]) + to_float(z[f * n + c]);
      continue;
    }
    for (int64_t c0 = 0; c0 < n;) {  // runs of channels that share one scale
      const int64_t ch0 = f * n + c0, g = ch0 / per;
      const int64_t run = std::min((g + 1) * per - ch0, n - c0);
      const float sc = to_float(s[g]), zc = to_float(z[g]);
      for (int64_t c = 0; c < run; ++c)
        dst[(ch0 + c) * stride] = static_cast<float>((row[c0 + c] >> shift) & mask) * sc + zc;
      c0 += run;
    }
  }
}

template <typename S, typename T>
void quant_prefill_item(const QuantPrefillArgs& a, int64_t b, int64_t h, int64_t t0) {
  const int64_t G = a.group, D = a.head_dim, Dv = a.v_head_dim, ps = a.page_size;
  const int64_t nt = std::min<int64_t>(a.positions, a.q_len - t0);
  auto row_index = [&](int64_t r) { return (b * a.q_len + t0 + r / G) * a.q_heads + h * G + r % G; };
  auto pos_of = [&](int64_t r) -> int64_t { return a.q_pos[b * a.q_len + t0 + r / G]; };
  const int64_t len = a.lengths[b], Q = std::max<int32_t>(a.quant_lengths[b], 0);
  int64_t top = -1, low = std::numeric_limits<int64_t>::max(), live = 0;
  bool sorted = true;
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t p = pos_of(t * G);
    if (p < 0) continue;  // padding, wherever it sits: sees nothing
    sorted &= p >= top;
    top = std::max(top, p);
    low = std::min(low, p);
    live = t + 1;
  }
  // Rows past the last real query (a chunk's padding) are written here, not attended.
  const int64_t R = live * G;  // row r: query t0 + r / G, head h * G + r % G
  for (int64_t r = R; r < nt * G; ++r) {
    std::fill(a.out + row_index(r) * Dv, a.out + (row_index(r) + 1) * Dv, 0.0f);
    a.lse[row_index(r)] = kNegInf;
  }
  if (R == 0) return;
  // Keys < hi: below the row's length and the tail ring's end, at or before a query.
  const int64_t hi = std::min({len, Q + a.ring, top + 1});
  const int64_t lo = a.window > 0 && top >= 0 ? std::max<int64_t>(0, low - a.window + 1) : 0;
  const int64_t kg = ps / a.k_srows;  // tokens per key scale row
  const int64_t vgs = Dv / a.v_groups;  // channels per value scale
  const int64_t kpack = D * a.k_bits / 8, vpack = Dv * a.v_bits / 8;
  const int64_t lh = a.layer * a.kv_heads + h;
  const uint8_t* kc = a.kc + lh * a.pages * ps * kpack;
  const uint8_t* vc = a.vc + lh * a.pages * ps * vpack;
  const S* ks = static_cast<const S*>(a.ks) + lh * a.pages * a.k_srows * D;
  const S* kz = static_cast<const S*>(a.kz) + lh * a.pages * a.k_srows * D;
  const S* vs = static_cast<const S*>(a.vs) + lh * a.pages * ps * a.v_groups;
  const S* vz = static_cast<const S*>(a.vz) + lh * a.pages * ps * a.v_groups;
  const T* tk = static_cast<const T*>(a.tk) + (h * a.batch + b) * a.ring * D;
  const T* tv = static_cast<const T*>(a.tv) + (h * a.batch + b) * a.ring * Dv;
  const int32_t* table = a.tables + b * a.max_pages;
  auto fill = [&](int64_t k0, int64_t nk, float* kt, float* vb, int64_t Dvp) {
    for (int64_t j = 0; j < kBlockKeys; ++j) {
      float* vd = vb + j * Dvp;
      if (j >= nk) {
        for (int64_t d = 0; d < D; ++d) kt[d * kBlockKeys + j] = 0.0f;
        std::fill(vd, vd + Dvp, 0.0f);
        continue;
      }
      const int64_t pos = k0 + j;
      if (pos < Q) {
        const int64_t col = std::min(pos / ps, a.max_pages - 1);  // clamped, as gathers are
        const int64_t page = clamp_index(table[col], a.pages), r = pos % ps;
        const uint8_t* kr = kc + (page * ps + r) * kpack;
        const S* s = ks + (page * a.k_srows + r / kg) * D;
        const S* z = kz + (page * a.k_srows + r / kg) * D;
        dequant_row(kr, D, a.k_bits, s, z, 1, kt + j, kBlockKeys);
        const uint8_t* vr = vc + (page * ps + r) * vpack;
        const S* sv = vs + (page * ps + r) * a.v_groups;
        const S* zv = vz + (page * ps + r) * a.v_groups;
        dequant_row(vr, Dv, a.v_bits, sv, zv, vgs, vd, 1);
      } else {
        const int64_t slot = pos % a.ring;
        for (int64_t d = 0; d < D; ++d) kt[d * kBlockKeys + j] = to_float(tk[slot * D + d]);
        for (int64_t d = 0; d < Dv; ++d) vd[d] = to_float(tv[slot * Dv + d]);
      }
      std::fill(vd + Dv, vd + Dvp, 0.0f);
    }
  };
  flash_rows(
      R, D, Dv, a.scale, a.soft_cap, a.window, lo, hi, sorted,
      [&](int64_t r) { return a.q + row_index(r) * D; }, pos_of, fill,
      [&](int64_t r, const float* o, float lse) {
        std::copy(o, o + Dv, a.out + row_index(r) * Dv);
        a.lse[row_index(r)] = lse;
      });
}

template <typename S>
void quant_prefill_tail(const QuantPrefillArgs& a, ffi::DataType tt, int64_t b, int64_t h,
                        int64_t t0) {
  if (tt == ffi::BF16) {
    quant_prefill_item<S, Bf16>(a, b, h, t0);
  } else if (tt == ffi::F16) {
    quant_prefill_item<S, Half>(a, b, h, t0);
  } else {
    quant_prefill_item<S, float>(a, b, h, t0);
  }
}

ffi::Error QuantizedPrefillImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                ffi::Buffer<ffi::U8> k_codes, ffi::AnyBuffer k_scale,
                                ffi::AnyBuffer k_zero, ffi::Buffer<ffi::U8> v_codes,
                                ffi::AnyBuffer v_scale, ffi::AnyBuffer v_zero,
                                ffi::AnyBuffer tail_k, ffi::AnyBuffer tail_v,
                                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> quant_lengths,
                                ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> q_pos,
                                ffi::Buffer<ffi::S32> tables, float scale, float soft_cap,
                                int64_t window, int64_t k_bits, int64_t v_bits,
                                int64_t item_rows, ffi::ResultBuffer<ffi::F32> out,
                                ffi::ResultBuffer<ffi::F32> lse) {
  auto qd = q.dimensions(), kd = k_codes.dimensions(), vd = v_codes.dimensions();
  auto ksd = k_scale.dimensions(), vsd = v_scale.dimensions(), td = tables.dimensions();
  auto tkd = tail_k.dimensions(), tvd = tail_v.dimensions(), qpd = q_pos.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || ksd.size() != 5 ||
      vsd.size() != 5 || td.size() != 2 || tkd.size() != 4 || tvd.size() != 4 ||
      qpd.size() != 2)
    return ffi::Error::InvalidArgument(
        "kvjax quantized prefill: expected q [batch, q_len, q_heads, head_dim], pools [layers, "
        "kv_heads, pages, ...], tails [kv_heads, batch, ring, width], q_pos [batch, q_len]");
  const auto st = k_scale.element_type();
  if (k_zero.element_type() != st || v_scale.element_type() != st ||
      v_zero.element_type() != st || (st != ffi::F16 && st != ffi::BF16 && st != ffi::F32))
    return ffi::Error::InvalidArgument(
        "kvjax quantized prefill: scales and zeros must share one dtype: f16, bf16 or f32");
  auto bits_ok = [](int64_t x) { return x == 2 || x == 4 || x == 8; };
  if (!bits_ok(k_bits) || !bits_ok(v_bits))
    return ffi::Error::InvalidArgument("kvjax quantized prefill: bits must be 2, 4 or 8");
  const auto tt = tail_k.element_type();
  if (tail_v.element_type() != tt || (tt != ffi::F32 && tt != ffi::BF16 && tt != ffi::F16))
    return ffi::Error::InvalidArgument(
        "kvjax quantized prefill: tails must both be f32, bf16 or f16");
  QuantPrefillArgs a;
  a.batch = qd[0];
  a.q_len = qd[1];
  a.q_heads = qd[2];
  a.head_dim = qd[3];
  a.kv_heads = kd[1];
  a.pages = kd[2];
  a.page_size = kd[3];
  a.v_head_dim = vd[4] * (8 / v_bits);
  a.k_bits = k_bits;
  a.v_bits = v_bits;
  a.k_srows = ksd[3];
  a.v_groups = vsd[4];
  a.ring = tkd[2];
  if (a.kv_heads <= 0 || a.q_heads % a.kv_heads || kd[4] * (8 / k_bits) != a.head_dim ||
      ksd[4] != a.head_dim || k_zero.dimensions()[3] != a.k_srows || a.v_head_dim <= 0 ||
      a.k_srows <= 0 || a.page_size % a.k_srows || a.v_groups <= 0 ||
      a.v_head_dim % a.v_groups || vsd[3] != a.page_size || vd[2] != a.pages ||
      vd[3] != a.page_size || td[0] != a.batch || qpd[0] != a.batch || qpd[1] != a.q_len ||
      quant_lengths.element_count() != static_cast<size_t>(a.batch) ||
      lengths.element_count() != static_cast<size_t>(a.batch) || tkd[0] != a.kv_heads ||
      tkd[1] != a.batch || tkd[3] != a.head_dim || tvd[0] != a.kv_heads || tvd[1] != a.batch ||
      tvd[2] != a.ring || tvd[3] != a.v_head_dim || a.ring <= 0 ||
      (8 / k_bits > 1 && a.head_dim % (8 / k_bits)) ||
      (8 / v_bits > 1 && a.v_head_dim % (8 / v_bits)))
    return ffi::Error::InvalidArgument("kvjax quantized prefill: inconsistent shapes");
  a.group = a.q_heads / a.kv_heads;
  a.q = q.typed_data();
  a.kc = k_codes.typed_data();
  a.vc = v_codes.typed_data();
  a.ks = k_scale.untyped_data();
  a.kz = k_zero.untyped_data();
  a.vs = v_scale.untyped_data();
  a.vz = v_zero.untyped_data();
  a.tk = tail_k.untyped_data();
  a.tv = tail_v.untyped_data();
  a.layer = clamp_index(layer.typed_data()[0], kd[0]);
  a.quant_lengths = quant_lengths.typed_data();
  a.lengths = lengths.typed_data();
  a.q_pos = q_pos.typed_data();
  a.tables = tables.typed_data();
  a.max_pages = td[1];
  a.scale = scale;
  a.soft_cap = soft_cap;
  a.window = window;
  a.out = out->typed_data();
  a.lse = lse->typed_data();
  if (a.batch == 0 || a.q_len == 0 || a.q_heads == 0) return ffi::Error::Success();
  a.positions = std::max<int64_t>(1, (std::max<int64_t>(item_rows, 1) + a.group - 1) / a.group);
  const int64_t blocks = (a.q_len + a.positions - 1) / a.positions;
  const int64_t kvh = a.kv_heads;
  parallel_for(&pool, a.batch * kvh * blocks, [&](int64_t i, int) {
    const int64_t blk = blocks - 1 - i / (a.batch * kvh), rest = i % (a.batch * kvh);
    const int64_t b = rest / kvh, h = rest % kvh, t0 = blk * a.positions;
    if (st == ffi::BF16) {
      quant_prefill_tail<Bf16>(a, tt, b, h, t0);
    } else if (st == ffi::F16) {
      quant_prefill_tail<Half>(a, tt, b, h, t0);
    } else {
      quant_prefill_tail<float>(a, tt, b, h, t0);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kvjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxPagedPrefill, kvjax::PagedPrefillImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // q
                                  .Arg<xla::ffi::AnyBuffer>()              // k pools
                                  .Arg<xla::ffi::AnyBuffer>()              // v pools
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // layer
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // lengths
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // block tables
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // q_lengths
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("item_rows")
                                  .Attr<int64_t>("q_bf16")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxQuantizedPrefill, kvjax::QuantizedPrefillImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // q
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // k codes
                                  .Arg<xla::ffi::AnyBuffer>()              // k scale
                                  .Arg<xla::ffi::AnyBuffer>()              // k zero
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // v codes
                                  .Arg<xla::ffi::AnyBuffer>()              // v scale
                                  .Arg<xla::ffi::AnyBuffer>()              // v zero
                                  .Arg<xla::ffi::AnyBuffer>()              // tail k
                                  .Arg<xla::ffi::AnyBuffer>()              // tail v
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // layer
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // quant lengths
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // lengths
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // q positions
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // block tables
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("k_bits")
                                  .Attr<int64_t>("v_bits")
                                  .Attr<int64_t>("item_rows")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // lse
