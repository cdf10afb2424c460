// The KIVI decode kernel's arguments and per-item entry point, shared by the FFI handler
// (quantized_decode.cc) and the three translation units that instantiate the kernel for
// each scale dtype (quantized_decode_{f16,bf16,f32}.cc, compiled in parallel: one unit
// holding all three took most of the library's build time).

#pragma once

#include "common.h"

namespace kvjax {

struct QuantArgs {
  const float* q;  // [batch, q_heads, head_dim]
  const uint8_t *kc, *vc;  // [layers, kv_heads, pages, page_size, width * bits / 8]
  const void *ks, *kz;     // [layers, kv_heads, pages, page_size / Gk, head_dim]
  const void *vs, *vz;     // [layers, kv_heads, pages, page_size, v_head_dim / Gv]
  int64_t layer;
  int64_t kv_heads, pages, page_size, head_dim, v_head_dim, q_heads, group;
  int64_t k_bits, v_bits, k_srows, v_groups;
  const int32_t* quant_lengths;  // [batch]
  const int32_t* lengths;        // [batch]
  const void *tk, *tv;           // tail rings [kv_heads, batch, ring, width]
  ffi::DataType tail_type;
  int64_t ring, tail_batch;
  const int32_t* q_pos;          // [batch]
  const int32_t* tables;         // [batch, max_pages]
  int64_t max_pages;
  float scale, soft_cap;
  int64_t window;
  Tuning tuning;    // per call: prefetch, touch, rows path, integer logits / values
  float* out;
  float* lse;
};

// Attention of (sequence b, KV head h) over its quantized pages and tail; S is the dtype
// of the scales and zeros (Half, Bf16 or float).
template <typename S>
void quant_dispatch(const QuantArgs& a, int64_t b, int64_t h);

extern template void quant_dispatch<Half>(const QuantArgs&, int64_t, int64_t);
extern template void quant_dispatch<Bf16>(const QuantArgs&, int64_t, int64_t);
extern template void quant_dispatch<float>(const QuantArgs&, int64_t, int64_t);

}  // namespace kvjax
