// Greedy decoding's argmax on CPU: out[r] = the first index of row r's largest value,
// a NaN counting as the largest (jnp.argmax's semantics). XLA:CPU runs the argmax of a
// decode step's [rows, vocab] logits as several passes of unvectorized reductions (2-3 ms
// for 32 x 32000 float32 on a 2-core Zen 4, a tenth of the serving engine's step); here
// a row is one vectorized pass for its maximum and NaNs (in L1 / L2) and a scan for the
// first index holding it. Rows are spread over threads.

#include "native.h"

namespace kvjax {
namespace {

int32_t argmax_row(const float* x, int64_t n) {
  vn best = vn{} + -std::numeric_limits<float>::infinity();
  vni nan = vni{};
  int64_t i = 0;
  for (; i + kNat <= n; i += kNat) {
    const vn v = loadn(x + i);
    nan |= v != v;
    best = v > best ? v : best;  // NaN compares false: skipped here, found below
  }
  float m = -std::numeric_limits<float>::infinity();
  bool any_nan = false;
  for (int l = 0; l < kNat; ++l) {
    m = std::max(m, best[l]);
    any_nan |= nan[l] != 0;
  }
  for (int64_t j = i; j < n; ++j) {
    if (x[j] != x[j]) any_nan = true;
    else m = std::max(m, x[j]);
  }
  for (int64_t j = 0; j < n; ++j) {
    if (any_nan ? x[j] != x[j] : x[j] == m) return static_cast<int32_t>(j);
  }
  return 0;  // n == 0
}

ffi::Error ArgmaxRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::ResultBuffer<ffi::S32> out) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || out->element_count() != static_cast<size_t>(xd[0]))
    return ffi::Error::InvalidArgument("kvjax argmax rows: expected x [rows, n] and out [rows]");
  const int64_t rows = xd[0], n = xd[1];
  const float* data = x.typed_data();
  int32_t* o = out->typed_data();
  auto item = [&](int64_t r, int) { o[r] = argmax_row(data + r * n, n); };
  if (rows * n < (64 << 10)) {
    for (int64_t r = 0; r < rows; ++r) item(r, 0);
  } else {
    parallel_for(&pool, rows, item);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kvjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxArgmaxRows, kvjax::ArgmaxRowsImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x [rows, n]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());  // [rows]
