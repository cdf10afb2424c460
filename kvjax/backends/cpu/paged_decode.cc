// Paged GQA decode attention on CPU: one pass over each live page, online softmax.
//
// Work item = (sequence b, KV head h). The item loads the G = q_heads / kv_heads query
// rows of its group once (scaled), then walks the sequence's visible tokens in chunks of
// 16 positions: it finds each token's row through the block table, computes the G x 16
// logits, folds them into a running (max, sum, accumulator) per query row, and
// accumulates p . V. Everything is float32. Head widths that are multiples of 32 (f32 or
// bf16 pages) take attend.h's `attend_rows`: rows read in place, bf16 widened in
// registers, query rows in register blocks, the next chunk's logits overlapping this
// chunk's softmax. Other widths and f16 widen 16 rows at a time into an L1-resident
// float32 buffer (`attend`). Items are spread over threads (common.h: parallel_for).
//
// Semantics are kernels_pallas/paged_attention/reference.py's decode: the query sits at
// position lengths[b] - 1 and sees key positions k < min(lengths[b], max_pages *
// page_size) with (lengths[b] - 1) - k < window when a window is set; a row that sees
// nothing returns 0 and lse -inf. Table entries are clamped into the pool (an entry
// outside it is a caller error that the Python wrapper reports when it can; clamping
// keeps the kernel from reading outside the buffer).

#include "attend.h"

namespace kvjax {
namespace {

struct DecodeArgs {
  const float* q;        // [batch, q_heads, head_dim]
  const void* k;         // [layers, kv_heads, pages, page_size, head_dim] (f32, bf16 or f16)
  const void* v;         // [layers, kv_heads, pages, page_size, v_head_dim]
  int64_t layer;
  int64_t kv_heads, pages, page_size, head_dim, v_head_dim, q_heads, group;
  const int32_t* lengths;  // [batch]
  const int32_t* tables;   // [batch, max_pages]
  int64_t max_pages;
  float scale, soft_cap;   // soft_cap <= 0: none
  int64_t window;          // <= 0: none
  Tuning tuning;
  float* out;              // [batch, q_heads, v_head_dim]
  float* lse;              // [batch, q_heads]
};

template <typename T, int DT, int DVT>
void decode_item(const DecodeArgs& a, int64_t b, int64_t h) {
  const int64_t G = a.group, D = a.head_dim, Dv = a.v_head_dim, ps = a.page_size;
  const int64_t Dp = round16(D), Dvp = round16(Dv);
  float* out = a.out + (b * a.q_heads + h * G) * Dv;
  float* lse = a.lse + b * a.q_heads + h * G;

  const int64_t len = a.lengths[b];
  const int64_t hi = std::min<int64_t>(len, a.max_pages * ps);
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  if (len <= 0 || lo >= hi) {
    std::fill(out, out + G * Dv, 0.0f);
    std::fill(lse, lse + G, kNegInf);
    return;
  }

  // Scratch: queries, accumulators, one chunk of widened rows, probabilities; one
  // allocation per item (~40 KiB at D = 128, G = 4), negligible next to the item's work.
  std::vector<float> scratch(G * Dp + G * Dvp + kLanes * (Dp + Dvp) + G * kLanes);
  float* qs = scratch.data();
  float* acc = qs + G * Dp;
  float* kbuf = acc + G * Dvp;
  float* vbuf = kbuf + kLanes * Dp;
  float* probs = vbuf + kLanes * Dvp;
  for (int64_t g = 0; g < G; ++g) {
    const float* qr = a.q + (b * a.q_heads + h * G + g) * D;
    for (int64_t d = 0; d < Dp; ++d) qs[g * Dp + d] = d < D ? qr[d] * a.scale : 0.0f;
  }

  const T* kbase = static_cast<const T*>(a.k) + (a.layer * a.kv_heads + h) * a.pages * ps * D;
  const T* vbase = static_cast<const T*>(a.v) + (a.layer * a.kv_heads + h) * a.pages * ps * Dv;
  const int32_t* table = a.tables + b * a.max_pages;
  auto row_of = [&](int64_t pos) {
    pos = std::min(std::max(pos, lo), hi - 1);  // masked lanes read a visible row
    return clamp_index(table[pos / ps], a.pages) * ps + pos % ps;
  };
  // A chunk lies in one page when pages hold whole chunks; its rows are then contiguous.
  const bool whole = ps % kLanes == 0;
  // A chunk of 16 visible rows of one page: read in place.
  auto contiguous = [&](int64_t c0) { return whole && c0 >= lo && c0 + kLanes <= hi; };
  auto prefetch = [&](int64_t c0) {
    if (whole) {
      const int64_t r0 = row_of(c0);
      prefetch_bytes(kbase + r0 * D, kLanes * D * sizeof(T));
      prefetch_bytes(vbase + r0 * Dv, kLanes * Dv * sizeof(T));
      return;
    }
    for (int j = 0; j < kLanes; ++j) {
      const int64_t r = row_of(c0 + j);
      prefetch_bytes(kbase + r * D, D * sizeof(T));
      prefetch_bytes(vbase + r * Dv, Dv * sizeof(T));
    }
  };

  if constexpr (!std::is_same_v<T, Half>) {
    // tuning.rows false runs these through the staging path below (for comparisons).
    if (a.tuning.rows && D % (2 * kLanes) == 0 && Dv % (2 * kLanes) == 0) {
      // Rows are read in place (bf16 widened in registers); a chunk that is not 16
      // contiguous visible rows has its rows copied into a small stage buffer first.
      // qs holds the scaled queries (Dp = D here).
      using E = std::conditional_t<std::is_same_v<T, Bf16>, uint16_t, float>;
      const E* kb = reinterpret_cast<const E*>(kbase);
      const E* vb = reinterpret_cast<const E*>(vbase);
      // Two stage buffers, used in turn: attend_rows holds two chunks at a time.
      std::vector<E> stage(2 * kLanes * (D + Dv));
      int turn = 0;
      auto load = [&](int64_t c0) -> RowChunk<E> {
        if (contiguous(c0)) {
          const int64_t r0 = row_of(c0);
          return {kb + r0 * D, D, vb + r0 * Dv, Dv};
        }
        E* ks = stage.data() + turn * kLanes * (D + Dv);
        E* vs = ks + kLanes * D;
        turn ^= 1;
        for (int j = 0; j < kLanes; ++j) {
          const int64_t r = row_of(c0 + j);
          std::memcpy(ks + j * D, kb + r * D, D * sizeof(E));
          std::memcpy(vs + j * Dv, vb + r * Dv, Dv * sizeof(E));
        }
        return {ks, D, vs, Dv};
      };
      auto locate = [&](int64_t c0) -> RowChunk<E> {
        if (contiguous(c0)) {
          const int64_t r0 = row_of(c0);
          return {kb + r0 * D, D, vb + r0 * Dv, Dv};
        }
        return {nullptr, 0, nullptr, 0};
      };
      attend_rows<RowChunk<E>, DT, DVT>(a.tuning, qs, G, D, Dv, lo, hi, a.soft_cap, load, prefetch, locate,
                                        out, lse);
      return;
    }
  }
  const bool in_place = whole && std::is_same_v<T, float> && D == Dp && Dv == Dvp;

  auto load = [&](int64_t c0) -> Chunk {
    if (contiguous(c0)) {
      const int64_t r0 = row_of(c0);
      if (in_place) {
        return {reinterpret_cast<const float*>(kbase) + r0 * D, D,
                reinterpret_cast<const float*>(vbase) + r0 * Dv, Dv};
      }
      if (D == Dp && Dv == Dvp) {
        to_f32(kbase + r0 * D, kLanes * D, kLanes * D, kbuf);
        to_f32(vbase + r0 * Dv, kLanes * Dv, kLanes * Dv, vbuf);
        return {kbuf, Dp, vbuf, Dvp};
      }
    }
    for (int j = 0; j < kLanes; ++j) {
      const int64_t r = row_of(c0 + j);
      to_f32(kbase + r * D, D, Dp, kbuf + j * Dp);
      to_f32(vbase + r * Dv, Dv, Dvp, vbuf + j * Dvp);
    }
    return {kbuf, Dp, vbuf, Dvp};
  };
  attend<DT, DVT>(a.tuning, qs, G, Dp, Dvp, Dv, lo, hi, a.soft_cap, load, prefetch, acc, probs,
                  out, lse);
}

template <typename T>
void decode_dispatch(const DecodeArgs& a, int64_t b, int64_t h) {
  // Unrolled code for the usual head dims; any other width runs the generic loops.
  if (a.head_dim == 128 && a.v_head_dim == 128) return decode_item<T, 128, 128>(a, b, h);
  if (a.head_dim == 64 && a.v_head_dim == 64) return decode_item<T, 64, 64>(a, b, h);
  if (a.head_dim == 256 && a.v_head_dim == 256) return decode_item<T, 256, 256>(a, b, h);
  return decode_item<T, 0, 0>(a, b, h);
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> tables,
                           float scale, float soft_cap, int64_t window, int64_t prefetch,
                           int64_t touch, int64_t rows, ffi::ResultBuffer<ffi::F32> out,
                           ffi::ResultBuffer<ffi::F32> lse) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || vd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument(
        "kvjax paged decode: expected q [batch, q_heads, head_dim], pools [layers, kv_heads, "
        "pages, page_size, width], tables [batch, max_pages]");
  const auto dt = k.element_type();
  if (v.element_type() != dt || (dt != ffi::F32 && dt != ffi::BF16 && dt != ffi::F16))
    return ffi::Error::InvalidArgument("kvjax paged decode: pools must both be f32, bf16 or f16");
  DecodeArgs a;
  const int64_t batch = qd[0];
  a.q = q.typed_data();
  a.k = k.untyped_data();
  a.v = v.untyped_data();
  a.kv_heads = kd[1];
  a.pages = kd[2];
  a.page_size = kd[3];
  a.head_dim = kd[4];
  a.v_head_dim = vd[4];
  a.q_heads = qd[1];
  if (a.kv_heads <= 0 || a.q_heads % a.kv_heads || qd[2] != a.head_dim || vd[0] != kd[0] ||
      vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3] || td[0] != batch ||
      lengths.element_count() != static_cast<size_t>(batch))
    return ffi::Error::InvalidArgument("kvjax paged decode: inconsistent shapes");
  a.group = a.q_heads / a.kv_heads;
  if (a.group > kMaxGroup)
    return ffi::Error::InvalidArgument("kvjax paged decode: at most 256 query heads per KV head");
  a.layer = clamp_index(layer.typed_data()[0], kd[0]);
  a.lengths = lengths.typed_data();
  a.tables = tables.typed_data();
  a.max_pages = td[1];
  a.scale = scale;
  a.soft_cap = soft_cap;
  a.window = window;
  a.tuning.prefetch = prefetch;
  a.tuning.touch = touch;
  a.tuning.rows = rows != 0;
  a.out = out->typed_data();
  a.lse = lse->typed_data();
  const int64_t kvh = a.kv_heads;
  parallel_for(&pool, batch * kvh, [&](int64_t i, int) {
    if (dt == ffi::BF16) {
      decode_dispatch<Bf16>(a, i / kvh, i % kvh);
    } else if (dt == ffi::F16) {
      decode_dispatch<Half>(a, i / kvh, i % kvh);
    } else {
      decode_dispatch<float>(a, i / kvh, i % kvh);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kvjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxPagedDecode, kvjax::PagedDecodeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // q
                                  .Arg<xla::ffi::AnyBuffer>()              // k pools
                                  .Arg<xla::ffi::AnyBuffer>()              // v pools
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // layer
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // lengths
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // block tables
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("prefetch")
                                  .Attr<int64_t>("touch")
                                  .Attr<int64_t>("rows")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // lse
