// The FFI handler of the KIVI decode kernel: checks the buffers, then runs
// `quant_dispatch` (quantized_kernel.h) over (sequence, KV head) items.

#include "quantized_decode.h"

namespace kvjax {
namespace {

ffi::Error QuantizedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::U8> k_codes, ffi::AnyBuffer k_scale,
                               ffi::AnyBuffer k_zero, ffi::Buffer<ffi::U8> v_codes,
                               ffi::AnyBuffer v_scale, ffi::AnyBuffer v_zero,
                               ffi::AnyBuffer tail_k, ffi::AnyBuffer tail_v,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> quant_lengths,
                               ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> q_pos,
                               ffi::Buffer<ffi::S32> tables,
                               float scale, float soft_cap, int64_t window, int64_t k_bits,
                               int64_t v_bits, int64_t prefetch, int64_t touch, int64_t rows,
                               int64_t int_logits, int64_t int_values,
                               ffi::ResultBuffer<ffi::F32> out,
                               ffi::ResultBuffer<ffi::F32> lse) {
  auto qd = q.dimensions(), kd = k_codes.dimensions(), vd = v_codes.dimensions();
  auto ksd = k_scale.dimensions(), vsd = v_scale.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || vd.size() != 5 || ksd.size() != 5 ||
      vsd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("kvjax quantized decode: unexpected ranks");
  const auto st = k_scale.element_type();
  if (k_zero.element_type() != st || v_scale.element_type() != st ||
      v_zero.element_type() != st || (st != ffi::F16 && st != ffi::BF16 && st != ffi::F32))
    return ffi::Error::InvalidArgument(
        "kvjax quantized decode: scales and zeros must share one dtype: f16, bf16 or f32");
  auto bits_ok = [](int64_t b) { return b == 2 || b == 4 || b == 8; };
  if (!bits_ok(k_bits) || !bits_ok(v_bits))
    return ffi::Error::InvalidArgument("kvjax quantized decode: bits must be 2, 4 or 8");
  const auto tt = tail_k.element_type();
  if (tail_v.element_type() != tt || (tt != ffi::F32 && tt != ffi::BF16 && tt != ffi::F16))
    return ffi::Error::InvalidArgument(
        "kvjax quantized decode: tails must both be f32, bf16 or f16");
  QuantArgs a;
  const int64_t batch = qd[0];
  auto tkd = tail_k.dimensions(), tvd = tail_v.dimensions();
  a.q = q.typed_data();
  a.kc = k_codes.typed_data();
  a.vc = v_codes.typed_data();
  a.ks = k_scale.untyped_data();
  a.kz = k_zero.untyped_data();
  a.vs = v_scale.untyped_data();
  a.vz = v_zero.untyped_data();
  a.kv_heads = kd[1];
  a.pages = kd[2];
  a.page_size = kd[3];
  a.head_dim = qd[2];
  a.v_head_dim = vd[4] * (8 / v_bits);
  a.q_heads = qd[1];
  a.k_bits = k_bits;
  a.v_bits = v_bits;
  a.k_srows = ksd[3];
  a.v_groups = vsd[4];
  if (a.kv_heads <= 0 || a.q_heads % a.kv_heads || kd[4] * (8 / k_bits) != a.head_dim ||
      ksd[4] != a.head_dim || k_zero.dimensions()[3] != a.k_srows ||
      a.v_head_dim <= 0 || a.k_srows <= 0 || a.page_size % a.k_srows ||
      a.v_groups <= 0 || a.v_head_dim % a.v_groups || vsd[3] != a.page_size ||
      td[0] != batch || quant_lengths.element_count() != static_cast<size_t>(batch) ||
      q_pos.element_count() != static_cast<size_t>(batch) ||
      lengths.element_count() != static_cast<size_t>(batch) || tkd.size() != 4 ||
      tvd.size() != 4 || tkd[0] != a.kv_heads || tkd[1] != batch || tkd[3] != a.head_dim ||
      tvd[0] != a.kv_heads || tvd[1] != batch || tvd[2] != tkd[2] ||
      tvd[3] != a.v_head_dim ||
      (8 / k_bits > 1 && a.head_dim % (8 / k_bits)) ||
      (8 / v_bits > 1 && a.v_head_dim % (8 / v_bits)))
    return ffi::Error::InvalidArgument("kvjax quantized decode: inconsistent shapes");
  a.group = a.q_heads / a.kv_heads;
  if (a.group > kMaxGroup)
    return ffi::Error::InvalidArgument("kvjax quantized decode: too many query heads per KV head");
  a.layer = clamp_index(layer.typed_data()[0], kd[0]);
  a.quant_lengths = quant_lengths.typed_data();
  a.lengths = lengths.typed_data();
  a.tk = tail_k.untyped_data();
  a.tv = tail_v.untyped_data();
  a.tail_type = tt;
  a.ring = tkd[2];
  a.tail_batch = batch;
  a.q_pos = q_pos.typed_data();
  a.tables = tables.typed_data();
  a.max_pages = td[1];
  a.scale = scale;
  a.soft_cap = soft_cap;
  a.window = window;
  a.tuning.prefetch = prefetch;
  a.tuning.touch = touch;
  a.tuning.rows = rows != 0;
  a.tuning.int_logits = int_logits != 0;
  a.tuning.int_values = int_values != 0;
  a.out = out->typed_data();
  a.lse = lse->typed_data();
  const int64_t kvh = a.kv_heads;
  parallel_for(&pool, batch * kvh, [&](int64_t i, int) {
    if (st == ffi::F16) {
      quant_dispatch<Half>(a, i / kvh, i % kvh);
    } else if (st == ffi::BF16) {
      quant_dispatch<Bf16>(a, i / kvh, i % kvh);
    } else {
      quant_dispatch<float>(a, i / kvh, i % kvh);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kvjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxQuantizedDecode, kvjax::QuantizedDecodeImpl,
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
                                  .Attr<int64_t>("prefetch")
                                  .Attr<int64_t>("touch")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("int_logits")
                                  .Attr<int64_t>("int_values")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // lse
