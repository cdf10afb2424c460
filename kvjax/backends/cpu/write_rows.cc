// Writes token rows into a cache pool in place: pool[layer, :, page[i], off[i], :] = x[i];
// reads them: out[i] = pool[layer, :, page[i], off[i], :]; copies whole pages in place:
// pool[:, :, dst[i]] = pool[:, :, src[i]]; and takes rows of a 2-D table (embeddings).
//
// XLA:CPU has no 16-bit float scatter or in-place dynamic-update-slice: a bf16 pool
// written with either is widened to float32 (or copied) whole, on every write of a few
// rows. This custom call aliases the pool to its result and
// copies only the rows. Semantics are `pool.at[layer, :, page, off, :].set(x,
// mode="drop")`: a row whose page or offset is out of range (the cache's sink entry) is
// skipped, as is every row when the layer is out of range.

#include "common.h"

namespace kvjax {
namespace {

ffi::Error WriteRowsImpl(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> page, ffi::Buffer<ffi::S32> off,
                         ffi::AnyBuffer x, ffi::RemainingArgs after,
                         ffi::Result<ffi::AnyBuffer> out) {
  (void)after;  // only orders the write after the ops that produce them (write_rows' `after`)
  auto pd = pool.dimensions(), xd = x.dimensions();
  if (pd.size() != 5 || xd.size() != 3 || x.element_type() != pool.element_type() ||
      xd[1] != pd[1] || xd[2] != pd[4] || page.element_count() != static_cast<size_t>(xd[0]) ||
      off.element_count() != static_cast<size_t>(xd[0]))
    return ffi::Error::InvalidArgument(
        "kvjax write rows: expected pool [layers, heads, pages, page_size, width], x [rows, "
        "heads, width] of the pool's dtype, page and offset [rows]");
  if (out->untyped_data() != pool.untyped_data())
    return ffi::Error::Internal("kvjax write rows: the result must alias the pool");
  const int64_t L = pd[0], H = pd[1], P = pd[2], ps = pd[3];
  const int64_t row = pd[4] * static_cast<int64_t>(ffi::ByteWidth(pool.element_type()));
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::Success();
  char* base = static_cast<char*>(out->untyped_data());
  const char* src = static_cast<const char*>(x.untyped_data());
  const int32_t* pg = page.typed_data();
  const int32_t* of = off.typed_data();
  for (int64_t i = 0; i < xd[0]; ++i) {
    if (pg[i] < 0 || pg[i] >= P || of[i] < 0 || of[i] >= ps) continue;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t dst = (((l * H + h) * P + pg[i]) * ps + of[i]) * row;
      std::memcpy(base + dst, src + (i * H + h) * row, row);
    }
  }
  return ffi::Error::Success();
}

// out[i, h] = pool[layer, h, page[i], off[i]]: the rows write_rows writes, gathered by
// copies (XLA:CPU's gather of a 16-bit pool moves about 0.5 GB/s); rows out of range, or
// every row of a layer out of range, read as zeros.
ffi::Error ReadRowsImpl(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> layer,
                        ffi::Buffer<ffi::S32> page, ffi::Buffer<ffi::S32> off,
                        ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pool.dimensions(), od = out->dimensions();
  if (pd.size() != 5 || od.size() != 3 || out->element_type() != pool.element_type() ||
      od[1] != pd[1] || od[2] != pd[4] || page.element_count() != static_cast<size_t>(od[0]) ||
      off.element_count() != static_cast<size_t>(od[0]))
    return ffi::Error::InvalidArgument(
        "kvjax read rows: expected pool [layers, heads, pages, page_size, width], out [rows, "
        "heads, width] of the pool's dtype, page and offset [rows]");
  const int64_t L = pd[0], H = pd[1], P = pd[2], ps = pd[3];
  const int64_t row = pd[4] * static_cast<int64_t>(ffi::ByteWidth(pool.element_type()));
  const int64_t l = layer.typed_data()[0];
  const char* base = static_cast<const char*>(pool.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t* pg = page.typed_data();
  const int32_t* of = off.typed_data();
  for (int64_t i = 0; i < od[0]; ++i) {
    const bool inside = l >= 0 && l < L && pg[i] >= 0 && pg[i] < P && of[i] >= 0 && of[i] < ps;
    for (int64_t h = 0; h < H; ++h) {
      char* d = dst + (i * H + h) * row;
      if (inside)
        std::memcpy(d, base + (((l * H + h) * P + pg[i]) * ps + of[i]) * row, row);
      else
        std::memset(d, 0, row);
    }
  }
  return ffi::Error::Success();
}

// out[i] = table[idx[i]] for a [rows, width] table of any dtype: an embedding lookup by
// row copies (XLA:CPU gathers 16-bit floats in float32, converting the whole table first).
// Indices follow jnp's: a negative one counts from the end, then they clamp to the table.
ffi::Error TakeRowsImpl(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> idx,
                        ffi::Result<ffi::AnyBuffer> out) {
  auto td = table.dimensions(), od = out->dimensions();
  if (td.size() != 2 || od.size() != 2 || out->element_type() != table.element_type() ||
      od[1] != td[1] || idx.element_count() != static_cast<size_t>(od[0]) || td[0] <= 0)
    return ffi::Error::InvalidArgument(
        "kvjax take rows: expected table [rows, width], indices [n] and out [n, width] of "
        "the table's dtype");
  const int64_t n = td[0];
  const int64_t row = td[1] * static_cast<int64_t>(ffi::ByteWidth(table.element_type()));
  const char* base = static_cast<const char*>(table.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t* ix = idx.typed_data();
  for (int64_t i = 0; i < od[0]; ++i) {
    int64_t r = ix[i] < 0 ? ix[i] + n : ix[i];
    r = std::min<int64_t>(std::max<int64_t>(r, 0), n - 1);
    std::memcpy(dst + i * row, base + r * row, row);
  }
  return ffi::Error::Success();
}

// pool[:, :, dst[i]] = pool[:, :, src[i]] for every layer and head, in order of i; pairs
// with an index out of range (the sink) are skipped.
ffi::Error CopyPagesImpl(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> src,
                         ffi::Buffer<ffi::S32> dst, ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pool.dimensions();
  if (pd.size() != 5 || src.element_count() != dst.element_count())
    return ffi::Error::InvalidArgument(
        "kvjax copy pages: expected pool [layers, heads, pages, page_size, width] and src, "
        "dst of one length");
  if (out->untyped_data() != pool.untyped_data())
    return ffi::Error::Internal("kvjax copy pages: the result must alias the pool");
  const int64_t LH = pd[0] * pd[1], P = pd[2];
  const int64_t page = pd[3] * pd[4] * static_cast<int64_t>(ffi::ByteWidth(pool.element_type()));
  char* base = static_cast<char*>(out->untyped_data());
  const int32_t* s = src.typed_data();
  const int32_t* d = dst.typed_data();
  for (size_t i = 0; i < src.element_count(); ++i) {
    if (s[i] < 0 || s[i] >= P || d[i] < 0 || d[i] >= P || s[i] == d[i]) continue;
    for (int64_t lh = 0; lh < LH; ++lh)
      std::memcpy(base + (lh * P + d[i]) * page, base + (lh * P + s[i]) * page, page);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kvjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxCopyPages, kvjax::CopyPagesImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()              // pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // src [n]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // dst [n]
                                  .Ret<xla::ffi::AnyBuffer>());            // pool (aliased)

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxTakeRows, kvjax::TakeRowsImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()              // table
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // indices [n]
                                  .Ret<xla::ffi::AnyBuffer>());            // [n, width]

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxReadRows, kvjax::ReadRowsImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()              // pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // layer
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // page [rows]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // offset [rows]
                                  .Ret<xla::ffi::AnyBuffer>());            // [rows, heads, w]

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxWriteRows, kvjax::WriteRowsImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()              // pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // layer
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // page [rows]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // offset [rows]
                                  .Arg<xla::ffi::AnyBuffer>()              // x [rows, heads, w]
                                  .RemainingArgs()                         // after (unread)
                                  .Ret<xla::ffi::AnyBuffer>());            // pool (aliased)
