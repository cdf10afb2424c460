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
// width (native.h): 6 rows x 4 zmm on AVX-512, 6 rows x 2 ymm on AVX2.
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

template <typename T>
void prefill_item(const PrefillArgs& a, int64_t b, int64_t h, int64_t t0) {
  const int64_t G = a.group, D = a.head_dim, Dv = a.v_head_dim, ps = a.page_size;
  const int64_t Dvp = (Dv + kNat - 1) / kNat * kNat;
  const int64_t qlen = std::min<int64_t>(std::max<int32_t>(a.q_lengths[b], 0), a.q_len);
  const int64_t nt = std::min<int64_t>(a.positions, a.q_len - t0);  // positions of the item
  const int64_t live = std::max<int64_t>(0, std::min(nt, qlen - t0));  // real queries
  const int64_t len = a.lengths[b];
  const int64_t pos0 = len - qlen + t0;  // position of query t0
  const int64_t hi = std::min({len, a.max_pages * ps, pos0 + live});  // keys < hi
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos0 - a.window + 1) : 0;
  const int64_t R = live * G;  // row r: position t0 + r / G, head h * G + r % G
  auto out_row = [&](int64_t r) {
    return a.out + ((b * a.q_len + t0 + r / G) * a.q_heads + h * G + r % G) * Dv;
  };
  auto lse_of = [&](int64_t r) -> float& {
    return a.lse[(b * a.q_len + t0 + r / G) * a.q_heads + h * G + r % G];
  };
  for (int64_t r = R; r < nt * G; ++r) {  // padding queries
    std::fill(out_row(r), out_row(r) + Dv, 0.0f);
    lse_of(r) = kNegInf;
  }
  if (R == 0) return;
  if (lo >= hi) {  // no key to see (an empty sequence, or positions before the cache)
    for (int64_t r = 0; r < R; ++r) {
      std::fill(out_row(r), out_row(r) + Dv, 0.0f);
      lse_of(r) = kNegInf;
    }
    return;
  }

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
  for (int64_t r = 0; r < Rp; ++r) {
    float* dst = qs + r * D;
    if (r < R) {
      const float* src = a.q + ((b * a.q_len + t0 + r / G) * a.q_heads + h * G + r % G) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * a.scale;
    } else {
      std::fill(dst, dst + D, 0.0f);
    }
  }
  std::fill(o, o + Rp * Dvp, 0.0f);
  std::fill(mx, mx + Rp, kNegInf);
  std::fill(sum, sum + Rp, 0.0f);

  const T* kbase = static_cast<const T*>(a.k) + (a.layer * a.kv_heads + h) * a.pages * ps * D;
  const T* vbase = static_cast<const T*>(a.v) + (a.layer * a.kv_heads + h) * a.pages * ps * Dv;
  const int32_t* table = a.tables + b * a.max_pages;
  const float cap = a.soft_cap;
  const v16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t k0 = lo; k0 < hi; k0 += kBlockKeys) {
    const int64_t nk = std::min<int64_t>(kBlockKeys, hi - k0);
    for (int64_t j = 0; j < kBlockKeys; ++j) {
      if (j < nk) {
        const int64_t pos = k0 + j;
        const int64_t row = clamp_index(table[pos / ps], a.pages) * ps + pos % ps;
        const T* kr = kbase + row * D;
        const T* vr = vbase + row * Dv;
        for (int64_t d = 0; d < D; ++d) kt[d * kBlockKeys + j] = to_float(kr[d]);
        float* vd = vb + j * Dvp;
        for (int64_t d = 0; d < Dv; ++d) vd[d] = to_float(vr[d]);
        std::fill(vd + Dv, vd + Dvp, 0.0f);
      } else {
        for (int64_t d = 0; d < D; ++d) kt[d * kBlockKeys + j] = 0.0f;
        std::fill(vb + j * Dvp, vb + (j + 1) * Dvp, 0.0f);
      }
    }
    // Rows whose last position is below k0 see nothing here (causal): the item's rows are
    // in position order, so only rows from `first` on take part.
    const int64_t first = std::max<int64_t>(0, (k0 - pos0) * G);
    const int64_t r_first = first / kRowBlock * kRowBlock;
    const int64_t kv_end = (nk + kKeyVecs * kNat - 1) / (kKeyVecs * kNat) * (kKeyVecs * kNat);
    for (int64_t r = r_first; r < Rp; r += kRowBlock)
      for (int64_t j0 = 0; j0 < kv_end; j0 += kKeyVecs * kNat)
        logits_block<kRowBlock>(qs + r * D, D, kt, j0, s + r * kBlockKeys);
    for (int64_t r = r_first; r < R; ++r) {
      float* sr = s + r * kBlockKeys;
      const int64_t pos = pos0 + r / G;
      const int64_t vis_lo = std::max<int64_t>(a.window > 0 ? pos - a.window + 1 : 0, k0) - k0;
      const int64_t vis_hi = std::min<int64_t>(pos + 1, k0 + nk) - k0;  // keys [vis_lo, vis_hi)
      if (vis_lo >= vis_hi) {
        std::fill(sr, sr + kBlockKeys, 0.0f);
        continue;
      }
      // Keys outside [vis_lo, vis_hi) are selected away (-inf), never weighted by 0.
      v16 x[kBlockKeys / kLanes];
      v16 top = splat(kNegInf);
      for (int c = 0; c < kBlockKeys / kLanes; ++c) {
        x[c] = load16(sr + c * kLanes);
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
    float* dst = out_row(r);
    if (sum[r] > 0.0f) {
      const float inv = 1.0f / sum[r];
      for (int64_t d = 0; d < Dv; ++d) dst[d] = o[r * Dvp + d] * inv;
      lse_of(r) = mx[r] + std::log(sum[r]);
    } else {
      std::fill(dst, dst + Dv, 0.0f);
      lse_of(r) = kNegInf;
    }
  }
}

ffi::Error PagedPrefillImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> tables,
                            ffi::Buffer<ffi::S32> q_lengths, float scale, float soft_cap,
                            int64_t window, int64_t item_rows, ffi::ResultBuffer<ffi::F32> out,
                            ffi::ResultBuffer<ffi::F32> lse) {
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
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // lse
