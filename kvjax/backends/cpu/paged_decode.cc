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
// Sequences whose block tables begin with the same pages read those pages once per call
// (runs, below), with the same bits.
//
// Semantics are kernels_pallas/paged_attention/reference.py's decode: the query sits at
// position lengths[b] - 1 and sees key positions k < min(lengths[b], max_pages *
// page_size) with (lengths[b] - 1) - k < window when a window is set; a row that sees
// nothing returns 0 and lse -inf. Table entries are clamped into the pool (an entry
// outside it is a caller error that the Python wrapper reports when it can; clamping
// keeps the kernel from reading outside the buffer).

#include <algorithm>
#include <utility>

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

template <typename C>
struct TypeTag {
  using type = C;
};

// Key positions the work items have walked, summed over items and calls, read and reset
// by KvjaxDecodePositionsWalked (tests: a shared page is walked once per run and KV
// head, not once per sequence). One relaxed add per work item.
std::atomic<int64_t> g_positions_walked{0};
inline void walked(int64_t n) { g_positions_walked.fetch_add(n, std::memory_order_relaxed); }

// Whether an item takes attend.h's attend_rows (rows read in place): f32 or bf16 pages
// with head widths that are multiples of 32, unless tuning.rows is off.
bool rows_path(const DecodeArgs& a) {
  return a.tuning.rows && a.head_dim % (2 * kLanes) == 0 && a.v_head_dim % (2 * kLanes) == 0;
}

// The rows of KV head h's pages as one sequence sees them (block table `table`, visible
// positions [lo, hi)), for pools of element type E: a position's pool row, whether a
// 16-position chunk is 16 contiguous visible rows of one page, and a chunk's prefetch.
template <typename E>
struct PageRows {
  const E* k;
  const E* v;
  int64_t D, Dv, ps, pages, lo, hi;
  const int32_t* table;
  bool whole;  // pages hold whole 16-position chunks: a chunk lies in one page

  PageRows(const DecodeArgs& a, int64_t h, const int32_t* tbl, int64_t lo_, int64_t hi_)
      : k(static_cast<const E*>(a.k) + (a.layer * a.kv_heads + h) * a.pages * a.page_size *
                                           a.head_dim),
        v(static_cast<const E*>(a.v) + (a.layer * a.kv_heads + h) * a.pages * a.page_size *
                                           a.v_head_dim),
        D(a.head_dim), Dv(a.v_head_dim), ps(a.page_size), pages(a.pages), lo(lo_), hi(hi_),
        table(tbl), whole(a.page_size % kLanes == 0) {}

  int64_t row(int64_t pos) const {
    pos = std::min(std::max(pos, lo), hi - 1);  // masked lanes read a visible row
    return clamp_index(table[pos / ps], pages) * ps + pos % ps;
  }
  bool contiguous(int64_t c0) const { return whole && c0 >= lo && c0 + kLanes <= hi; }
  void prefetch(int64_t c0) const {
    if (whole) {
      const int64_t r0 = row(c0);
      prefetch_bytes(k + r0 * D, kLanes * D * sizeof(E));
      prefetch_bytes(v + r0 * Dv, kLanes * Dv * sizeof(E));
      return;
    }
    for (int j = 0; j < kLanes; ++j) {
      const int64_t r = row(c0 + j);
      prefetch_bytes(k + r * D, D * sizeof(E));
      prefetch_bytes(v + r * Dv, Dv * sizeof(E));
    }
  }
};

// Calls fn(tag, load, prefetch, locate) with the chunk accessors of attend_rows over the
// visible positions [lo, hi) of KV head h of the sequence whose block table is `table`;
// tag::type is the chunk type (RowChunk of float, or of uint16_t for bf16 bits). Rows are
// read in place; a chunk that is not 16 contiguous visible rows has its rows copied into
// a small stage buffer first.
template <typename T, typename Fn>
void with_rows(const DecodeArgs& a, int64_t h, const int32_t* table, int64_t lo, int64_t hi,
               Fn&& fn) {
  using E = std::conditional_t<std::is_same_v<T, Bf16>, uint16_t, float>;
  const PageRows<E> pr(a, h, table, lo, hi);
  const int64_t D = pr.D, Dv = pr.Dv;
  auto prefetch = [&](int64_t c0) { pr.prefetch(c0); };
  // Two stage buffers, used in turn: attend_rows holds two chunks at a time.
  std::vector<E> stage(2 * kLanes * (D + Dv));
  int turn = 0;
  auto locate = [&](int64_t c0) -> RowChunk<E> {
    if (pr.contiguous(c0)) {
      const int64_t r0 = pr.row(c0);
      return {pr.k + r0 * D, D, pr.v + r0 * Dv, Dv};
    }
    return {nullptr, 0, nullptr, 0};
  };
  auto load = [&](int64_t c0) -> RowChunk<E> {
    if (pr.contiguous(c0)) return locate(c0);
    E* ks = stage.data() + turn * kLanes * (D + Dv);
    E* vs = ks + kLanes * D;
    turn ^= 1;
    for (int j = 0; j < kLanes; ++j) {
      const int64_t r = pr.row(c0 + j);
      std::memcpy(ks + j * D, pr.k + r * D, D * sizeof(E));
      std::memcpy(vs + j * Dv, pr.v + r * Dv, Dv * sizeof(E));
    }
    return {ks, D, vs, Dv};
  };
  fn(TypeTag<RowChunk<E>>{}, load, prefetch, locate);
}

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

  const int32_t* table = a.tables + b * a.max_pages;
  walked(hi - lo);

  if constexpr (!std::is_same_v<T, Half>) {
    // tuning.rows false runs these through the staging path below (for comparisons).
    if (rows_path(a)) {
      with_rows<T>(a, h, table, lo, hi, [&](auto tag, auto& ld, auto& pf, auto& loc) {
        using C = typename decltype(tag)::type;
        attend_rows<C, DT, DVT>(a.tuning, qs, G, D, Dv, lo, hi, a.soft_cap, ld, pf, loc, out,
                                lse);
      });
      return;
    }
  }
  const PageRows<T> pr(a, h, table, lo, hi);
  const bool in_place = pr.whole && std::is_same_v<T, float> && D == Dp && Dv == Dvp;
  auto prefetch = [&](int64_t c0) { pr.prefetch(c0); };
  auto load = [&](int64_t c0) -> Chunk {
    if (pr.contiguous(c0)) {
      const int64_t r0 = pr.row(c0);
      if (in_place) {
        return {reinterpret_cast<const float*>(pr.k) + r0 * D, D,
                reinterpret_cast<const float*>(pr.v) + r0 * Dv, Dv};
      }
      if (D == Dp && Dv == Dvp) {
        to_f32(pr.k + r0 * D, kLanes * D, kLanes * D, kbuf);
        to_f32(pr.v + r0 * Dv, kLanes * Dv, kLanes * Dv, vbuf);
        return {kbuf, Dp, vbuf, Dvp};
      }
    }
    for (int j = 0; j < kLanes; ++j) {
      const int64_t r = pr.row(c0 + j);
      to_f32(pr.k + r * D, D, Dp, kbuf + j * Dp);
      to_f32(pr.v + r * Dv, Dv, Dvp, vbuf + j * Dvp);
    }
    return {kbuf, Dp, vbuf, Dvp};
  };
  attend<DT, DVT>(a.tuning, qs, G, Dp, Dvp, Dv, lo, hi, a.soft_cap, load, prefetch, acc, probs,
                  out, lse);
}

// Calls fn(DT, DVT) with the widths as integral constants: unrolled code for the usual
// head dims; any other width runs the generic loops (0, 0).
template <typename Fn>
void by_widths(const DecodeArgs& a, Fn&& fn) {
  using std::integral_constant;
  if (a.head_dim == 128 && a.v_head_dim == 128)
    return fn(integral_constant<int, 128>{}, integral_constant<int, 128>{});
  if (a.head_dim == 64 && a.v_head_dim == 64)
    return fn(integral_constant<int, 64>{}, integral_constant<int, 64>{});
  if (a.head_dim == 256 && a.v_head_dim == 256)
    return fn(integral_constant<int, 256>{}, integral_constant<int, 256>{});
  return fn(integral_constant<int, 0>{}, integral_constant<int, 0>{});
}

template <typename T>
void decode_dispatch(const DecodeArgs& a, int64_t b, int64_t h) {
  by_widths(a, [&](auto dt, auto dvt) { decode_item<T, dt.value, dvt.value>(a, b, h); });
}

// ---- Pages shared by several sequences, read once per call ----
//
// Sequences whose block tables begin with the same pages (prefix caching, fork) see the
// same keys and values there. Their query rows take those pages together in one work item
// per KV head (a "run"), as if they were one item's G x n rows, so each shared page is
// read once instead of once per sequence; each sequence then continues alone over the
// rest of its pages from the run's state (RowState). A row's arithmetic is unchanged
// (attend_rows computes each row on its own, in chunk order), so the results are the
// same bits as without runs. Only the rows path takes runs, and no sliding window.

struct SharedRun {
  std::vector<int64_t> rows;  // its sequences, ascending
  int64_t tokens = 0;         // leading positions all of them read through the same pages
};

// Runs of sequences that share at least `share` leading tokens (a multiple of 16),
// split until there are as many work items (runs x kv_heads) as workers. Greedy: the
// first sequence not yet in a run leads, and takes the later sequences that start on its
// pages, as many as maximizes the tokens saved (a longer common prefix with fewer
// sequences may save more). A run holds at most kMaxGroup / group sequences.
std::vector<SharedRun> shared_runs(const int32_t* lengths, const int32_t* tables,
                                   int64_t batch, int64_t max_pages, int64_t page_size,
                                   int64_t group, int64_t kv_heads, int64_t share,
                                   int64_t workers) {
  std::vector<SharedRun> runs;
  if (share <= 0 || group <= 0 || group > kMaxGroup || page_size <= 0) return runs;
  const int64_t ps = page_size;
  std::vector<int64_t> full(batch);  // whole visible pages of each sequence
  for (int64_t b = 0; b < batch; ++b)
    full[b] = std::max<int64_t>(0, std::min<int64_t>(lengths[b], max_pages * ps)) / ps;
  std::vector<char> taken(batch, 0);
  const int64_t max_rows = kMaxGroup / group;
  std::vector<std::pair<int64_t, int64_t>> cand;  // (common pages, sequence)
  for (int64_t b = 0; b < batch; ++b) {
    if (taken[b] || full[b] == 0) continue;
    const int32_t* tb = tables + b * max_pages;
    cand.clear();
    for (int64_t c = b + 1; c < batch; ++c) {
      if (taken[c] || full[c] == 0) continue;
      const int32_t* tc = tables + c * max_pages;
      const int64_t limit = std::min(full[b], full[c]);
      int64_t n = 0;
      while (n < limit && tc[n] == tb[n]) ++n;
      if (n > 0) cand.emplace_back(n, c);
    }
    std::stable_sort(cand.begin(), cand.end(),
                     [](const auto& x, const auto& y) { return x.first > y.first; });
    int64_t best = 0, best_saved = 0;
    for (int64_t k = 1; k <= static_cast<int64_t>(cand.size()) && k < max_rows; ++k) {
      const int64_t tokens = cand[k - 1].first * ps / kLanes * kLanes;
      if (tokens >= share && k * tokens > best_saved) best = k, best_saved = k * tokens;
    }
    if (!best) continue;
    SharedRun run;
    run.tokens = cand[best - 1].first * ps / kLanes * kLanes;
    run.rows.push_back(b);
    for (int64_t k = 0; k < best; ++k) run.rows.push_back(cand[k].second);
    for (int64_t r : run.rows) taken[r] = 1;
    std::sort(run.rows.begin(), run.rows.end());
    runs.push_back(std::move(run));
  }
  // Fewer items than workers would leave workers idle while the runs are read: halve the
  // largest run (each half still reads its pages once) while that helps.
  while (!runs.empty() && static_cast<int64_t>(runs.size()) * kv_heads < workers) {
    auto largest = std::max_element(runs.begin(), runs.end(), [](const auto& x, const auto& y) {
      return x.rows.size() < y.rows.size();
    });
    if (largest->rows.size() < 4) break;
    SharedRun half;
    half.tokens = largest->tokens;
    const auto mid = largest->rows.begin() + largest->rows.size() / 2;
    half.rows.assign(mid, largest->rows.end());
    largest->rows.erase(mid, largest->rows.end());
    runs.push_back(std::move(half));
  }
  return runs;
}

// The run's shared positions for KV head h: every member's G query rows in one state,
// then each member's rows copied to its own state in `states` ([batch, kv_heads] states
// of G rows).
template <typename T, int DT, int DVT>
void run_item(const DecodeArgs& a, const SharedRun& run, int64_t h, float* states) {
  const int64_t G = a.group, D = a.head_dim, Dv = a.v_head_dim;
  const int64_t n = static_cast<int64_t>(run.rows.size()), rows = n * G;
  std::vector<float> qs(rows * D);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const float* qr = a.q + (run.rows[i] * a.q_heads + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) qs[(i * G + g) * D + d] = qr[d] * a.scale;
    }
  AlignedFloats mem = aligned_floats(RowState::floats(rows, D, Dv));
  const RowState st = RowState::at(mem.get(), rows, D, Dv);
  const int32_t* table = a.tables + run.rows[0] * a.max_pages;
  walked(run.tokens);
  with_rows<T>(a, h, table, 0, run.tokens, [&](auto tag, auto& ld, auto& pf, auto& loc) {
    using C = typename decltype(tag)::type;
    row_state_start(st, qs.data(), rows, D, Dv, kSplitRows<C>);
    attend_rows_run<C, DT, DVT>(a.tuning, st, rows, D, Dv, 0, 0, run.tokens, a.soft_cap, ld, pf,
                                loc);
  });
  const int64_t per = RowState::floats(G, D, Dv);
  for (int64_t i = 0; i < n; ++i) {
    const RowState dst = RowState::at(states + (run.rows[i] * a.kv_heads + h) * per, G, D, Dv);
    std::copy(st.lsum + i * G, st.lsum + (i + 1) * G, dst.lsum);
    std::copy(st.acc + i * G * Dv, st.acc + (i + 1) * G * Dv, dst.acc);
    std::copy(st.q + i * G * D, st.q + (i + 1) * G * D, dst.q);
    std::copy(st.m + i * G, st.m + (i + 1) * G, dst.m);
  }
}

// A run member's own positions [tokens, end) for KV head h, from its state.
template <typename T, int DT, int DVT>
void member_item(const DecodeArgs& a, int64_t b, int64_t h, int64_t tokens, float* states) {
  const int64_t G = a.group, D = a.head_dim, Dv = a.v_head_dim;
  const int64_t hi = std::min<int64_t>(a.lengths[b], a.max_pages * a.page_size);
  const RowState st = RowState::at(states + (b * a.kv_heads + h) * RowState::floats(G, D, Dv),
                                   G, D, Dv);
  walked(hi - tokens);
  with_rows<T>(a, h, a.tables + b * a.max_pages, 0, hi,
               [&](auto tag, auto& ld, auto& pf, auto& loc) {
                 using C = typename decltype(tag)::type;
                 attend_rows_run<C, DT, DVT>(a.tuning, st, G, D, Dv, tokens, 0, hi, a.soft_cap,
                                             ld, pf, loc);
                 row_state_finish(st, G, Dv, kSplitRows<C>, a.out + (b * a.q_heads + h * G) * Dv,
                                  a.lse + b * a.q_heads + h * G);
               });
}

// Every item of a call with runs: the runs first, then every sequence (members from
// their run's state, the others as without runs).
template <typename T>
void decode_with_runs(ffi::ThreadPool* pool, const DecodeArgs& a, int64_t batch,
                      const std::vector<SharedRun>& runs) {
  const int64_t kvh = a.kv_heads;
  const int64_t per = RowState::floats(a.group, a.head_dim, a.v_head_dim);
  AlignedFloats states = aligned_floats(batch * kvh * per);
  std::vector<int64_t> tokens(batch, 0);
  for (const SharedRun& run : runs)
    for (int64_t b : run.rows) tokens[b] = run.tokens;
  by_widths(a, [&](auto dt, auto dvt) {
    constexpr int DT = dt.value, DVT = dvt.value;
    parallel_for(pool, static_cast<int64_t>(runs.size()) * kvh, [&](int64_t i, int) {
      run_item<T, DT, DVT>(a, runs[i / kvh], i % kvh, states.get());
    });
    parallel_for(pool, batch * kvh, [&](int64_t i, int) {
      const int64_t b = i / kvh, h = i % kvh;
      if (tokens[b]) {
        member_item<T, DT, DVT>(a, b, h, tokens[b], states.get());
      } else {
        decode_item<T, DT, DVT>(a, b, h);
      }
    });
  });
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> tables,
                           float scale, float soft_cap, int64_t window, int64_t prefetch,
                           int64_t touch, int64_t rows, int64_t share,
                           ffi::ResultBuffer<ffi::F32> out,
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
  a.tuning.share = share;
  a.out = out->typed_data();
  a.lse = lse->typed_data();
  const int64_t kvh = a.kv_heads;
  if (dt != ffi::F16 && a.window <= 0 && rows_path(a)) {
    const std::vector<SharedRun> runs =
        shared_runs(a.lengths, a.tables, batch, a.max_pages, a.page_size, a.group, kvh,
                    a.tuning.share, parallel_workers(&pool));
    if (!runs.empty()) {
      if (dt == ffi::BF16) {
        decode_with_runs<Bf16>(&pool, a, batch, runs);
      } else {
        decode_with_runs<float>(&pool, a, batch, runs);
      }
      return ffi::Error::Success();
    }
  }
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
                                  .Attr<int64_t>("share")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // lse

// The runs the decode kernel forms (for tests and tools): run_of[b] is sequence b's run
// (-1: none) and tokens[b] the positions it reads in that run; returns the number of
// runs. Arguments as the kernel's: lengths [batch], tables [batch, max_pages].
extern "C" int64_t KvjaxSharedRuns(const int32_t* lengths, const int32_t* tables,
                                   int64_t batch, int64_t max_pages, int64_t page_size,
                                   int64_t group, int64_t kv_heads, int64_t share,
                                   int64_t workers, int64_t* run_of, int64_t* tokens) {
  const auto runs = kvjax::shared_runs(lengths, tables, batch, max_pages, page_size, group,
                                       kv_heads, share, workers);
  std::fill(run_of, run_of + batch, -1);
  std::fill(tokens, tokens + batch, 0);
  for (size_t r = 0; r < runs.size(); ++r)
    for (int64_t b : runs[r].rows) run_of[b] = static_cast<int64_t>(r), tokens[b] = runs[r].tokens;
  return static_cast<int64_t>(runs.size());
}

// The key positions the paged decode kernel's work items have walked since the last
// call (each item adds the positions it reads: a sequence's visible ones, a run's shared
// ones once for all its members, a member's own after the run); resets the count.
extern "C" int64_t KvjaxDecodePositionsWalked() {
  return kvjax::g_positions_walked.exchange(0, std::memory_order_relaxed);
}
