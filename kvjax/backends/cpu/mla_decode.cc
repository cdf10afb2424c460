// MLA decode attention in absorbed form on CPU: MQA over the latent cache.
//
// One work item per sequence: all q_heads query rows [q_latent, q_rope] against the keys
// [c_kv, k_rope] of the sequence's pages, with the latent c_kv as the values. Each chunk
// of 16 tokens is widened once into an L1/L2-resident float32 buffer laid out as
// [c_kv | k_rope | 0 pad] per row; the values are the c_kv part of the same rows, so the
// latent pages are read once for both products. Semantics:
// kernels_pallas/mla_decode/reference.py's decode (query at lengths[b] - 1, no cap or
// window; a row that sees nothing returns 0 and lse -inf).

#include "attend.h"

namespace kvjax {
namespace {

struct MlaArgs {
  const float* q;      // [batch, q_heads, d_c + d_rope], queries (latent | rope)
  const void* latent;  // [layers, 1, pages, page_size, d_c]
  const void* rope;    // [layers, 1, pages, page_size, d_rope]
  int64_t layer, pages, page_size, d_c, d_rope, q_heads;
  const int32_t* lengths;  // [batch]
  const int32_t* tables;   // [batch, max_pages]
  int64_t max_pages;
  float scale;
  Tuning tuning;
  float* out;  // [batch, q_heads, d_c]
  float* lse;  // [batch, q_heads]
};

template <typename T>
void mla_item(const MlaArgs& a, int64_t b) {
  const int64_t G = a.q_heads, Dc = a.d_c, Dr = a.d_rope, D = Dc + Dr, ps = a.page_size;
  const int64_t Dp = round16(D), Dvp = round16(Dc);
  float* out = a.out + b * G * Dc;
  float* lse = a.lse + b * G;
  const int64_t hi = std::min<int64_t>(a.lengths[b], a.max_pages * ps);
  if (hi <= 0) {
    std::fill(out, out + G * Dc, 0.0f);
    std::fill(lse, lse + G, kNegInf);
    return;
  }
  std::vector<float> scratch(G * Dp + G * Dvp + kLanes * Dp + G * kLanes);
  float* qs = scratch.data();
  float* acc = qs + G * Dp;
  float* kbuf = acc + G * Dvp;
  float* probs = kbuf + kLanes * Dp;
  for (int64_t g = 0; g < G; ++g) {
    const float* qr = a.q + (b * G + g) * D;
    for (int64_t d = 0; d < Dp; ++d) qs[g * Dp + d] = d < D ? qr[d] * a.scale : 0.0f;
  }
  const T* lat = static_cast<const T*>(a.latent) + a.layer * a.pages * ps * Dc;
  const T* rop = static_cast<const T*>(a.rope) + a.layer * a.pages * ps * Dr;
  const int32_t* table = a.tables + b * a.max_pages;
  auto row_of = [&](int64_t pos) {
    pos = std::min(pos, hi - 1);  // lanes past the length read a visible row (masked)
    return clamp_index(table[pos / ps], a.pages) * ps + pos % ps;
  };
  auto load = [&](int64_t c0) -> Chunk {
    for (int j = 0; j < kLanes; ++j) {
      const int64_t r = row_of(c0 + j);
      float* dst = kbuf + j * Dp;
      to_f32(lat + r * Dc, Dc, Dc, dst);
      to_f32(rop + r * Dr, Dr, Dp - Dc, dst + Dc);
    }
    // Values: the latent part of the same rows (columns past d_c feed only accumulator
    // lanes that are never written out).
    return {kbuf, Dp, kbuf, Dp};
  };
  auto prefetch = [&](int64_t c0) {
    for (int j = 0; j < kLanes; ++j) {
      const int64_t r = row_of(c0 + j);
      prefetch_bytes(lat + r * Dc, Dc * sizeof(T));
      prefetch_bytes(rop + r * Dr, Dr * sizeof(T));
    }
  };
  attend<0, 0>(a.tuning, qs, G, Dp, Dvp, Dc, 0, hi, 0.0f, load, prefetch, acc, probs, out, lse);
}

ffi::Error MlaDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer latent,
                         ffi::AnyBuffer rope, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> tables,
                         float scale, int64_t prefetch, ffi::ResultBuffer<ffi::F32> out,
                         ffi::ResultBuffer<ffi::F32> lse) {
  auto qd = q.dimensions(), ld = latent.dimensions(), rd = rope.dimensions();
  auto td = tables.dimensions();
  if (qd.size() != 3 || ld.size() != 5 || rd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("kvjax mla decode: unexpected ranks");
  const auto dt = latent.element_type();
  if (rope.element_type() != dt || (dt != ffi::F32 && dt != ffi::BF16 && dt != ffi::F16))
    return ffi::Error::InvalidArgument("kvjax mla decode: pools must share f32, bf16 or f16");
  MlaArgs a;
  const int64_t batch = qd[0];
  a.q = q.typed_data();
  a.latent = latent.untyped_data();
  a.rope = rope.untyped_data();
  a.pages = ld[2];
  a.page_size = ld[3];
  a.d_c = ld[4];
  a.d_rope = rd[4];
  a.q_heads = qd[1];
  if (ld[1] != 1 || rd[0] != ld[0] || rd[1] != 1 || rd[2] != ld[2] || rd[3] != ld[3] ||
      qd[2] != a.d_c + a.d_rope || td[0] != batch ||
      lengths.element_count() != static_cast<size_t>(batch))
    return ffi::Error::InvalidArgument("kvjax mla decode: inconsistent shapes");
  if (a.q_heads > kMaxGroup)
    return ffi::Error::InvalidArgument("kvjax mla decode: at most 256 query heads");
  a.layer = clamp_index(layer.typed_data()[0], ld[0]);
  a.lengths = lengths.typed_data();
  a.tables = tables.typed_data();
  a.max_pages = td[1];
  a.scale = scale;
  a.tuning.prefetch = prefetch;
  a.out = out->typed_data();
  a.lse = lse->typed_data();
  parallel_for(&pool, batch, [&](int64_t i, int) {
    if (dt == ffi::BF16) {
      mla_item<Bf16>(a, i);
    } else if (dt == ffi::F16) {
      mla_item<Half>(a, i);
    } else {
      mla_item<float>(a, i);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kvjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxMlaDecode, kvjax::MlaDecodeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // q (latent|rope)
                                  .Arg<xla::ffi::AnyBuffer>()              // latent pools
                                  .Arg<xla::ffi::AnyBuffer>()              // rope pools
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // layer
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // lengths
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // block tables
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("prefetch")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // lse
