// Matmul on CPU: y[M, N] = x[M, K] @ w[K, N], float32 accumulation. A few rows (decode)
// stream w at memory speed (one row, with the `sweep` attribute: sweep_columns below);
// many rows (the `packed` attribute > 0: prefill, training) run the packed GEMM at the
// end of this file.
//
// Decode multiplies a few activation rows (batch x new tokens) by every weight matrix
// once per step, so the op is bound by reading w; XLA:CPU's dot streams those weights
// at a third of the memory bandwidth for M = 8. Here each weight byte is read once: the
// N columns are cut into blocks (work items, spread over the caller and the helper
// threads); a block is walked panel by panel (`panel` rows of the block), and within a
// panel tile by tile (`tile_vectors` vectors of the target's width), a tile's M x width
// sums in registers while its rows stream in, carried between panels in y. Short panels
// keep the rows in flight few and read each as a contiguous piece of the block's width;
// a walk of one narrow tile over all K (a new 4 KiB page every row) ran at 60-70% of the
// panel walk's speed with prefetching and a third of it without (benchmarks/matmul.py
// --sweep). The hardware prefetcher does not follow the walk, so each tile row
// prefetches (into L2) the row `ahead` rows below it. Rows beyond one register block
// (kMaxRows) run in further blocks over the same tile, then in L1 / L2.
// Stacked weights [layers, K, N] are read in place at the `layer` operand's offset.
//
// Weights are float32 or bfloat16 ([K, N], row-major, as kvjax stores them). bfloat16
// is widened in registers: a vector load holds 2 kNat columns; shifting each 32-bit lane
// left by 16 gives the even columns as float32, masking the low half the odd ones; the
// two accumulators are interleaved back at the store. y is float32; x is float32 or
// bfloat16 (widened into a float32 copy, a few rows, for every path but the next).
// bfloat16 x with bfloat16 weights on a build with AVX512_BF16 (Zen 4, Cooper Lake and
// later Xeons) runs the tiles on vdpbf16ps instead (tile_dp): each instruction takes two
// k's per lane, a pair of weight rows interleaved by one unpack each, so the few-row walk
// does half the multiply-add instructions; the products of two bf16 values are exact in
// float32 either way, only the order of the float32 sums differs. Columns past the last
// whole vector (float32) or two (bf16) run a scalar loop. Stacked weights work the same
// in the packed GEMM.

#include "native.h"

namespace kvjax {
namespace {

// Rows per register block: MR accumulators of NV vectors of the target's width
// (native.h), NV weight vectors and a broadcast fit the register file. AVX-512 (32 zmm): 8
// rows x 2 vectors. AVX2 (16 ymm): float32 tiles 4 rows x 3 vectors, two full blocks for
// 8 rows (a 6 x 2 block left rows 7-8 a block of 4 accumulators, one FMA per cycle behind
// their latency: 4 x 3 measured 1.19x at 8 rows on cold weights, the same at 1); bf16
// tiles (two accumulators per row, even and odd columns) 6 rows. With the 64-byte vectors
// of common.h an AVX2 build spilled, and ran slower than XLA's dot on AVX2-only CPUs.
#if KVJAX_NAT == 16
constexpr int kMaxRows = 8;
constexpr int kMaxRowsBf16 = 8;
constexpr int kTileVectors = 2;  // float32 tile width in vectors (tile_vectors = 0)
#elif KVJAX_NAT == 8
constexpr int kMaxRows = 4;
constexpr int kMaxRowsBf16 = 6;
constexpr int kTileVectors = 3;
#else
constexpr int kMaxRows = 4;
constexpr int kMaxRowsBf16 = 4;
constexpr int kTileVectors = 2;
#endif

constexpr int64_t kMinParallelBytes = 256 << 10;  // smaller weights: caller thread only

struct MatmulArgs {
  const float* x;  // [M, K]
  const uint16_t* xh;  // [M, K] the bfloat16 x that x widens, where tile_dp may read it
  const void* w;   // [K, N] float32 or bfloat16
  float* y;        // [M, N]
  int64_t M, K, N;
  int64_t ahead;   // rows prefetched ahead by each tile (0: none)
};

inline void prefetch_l2(const void* p) { prefetch_line<1>(p); }

// Prefetches `lines` cache lines from p, plus the line of the piece's last byte (pieces
// need not start on a line).
inline void prefetch_piece(const char* p, int lines) {
  for (int i = 0; i < lines; ++i) prefetch_l2(p + 64 * i);
  prefetch_l2(p + 64 * lines - 1);
}

// f(std::integral_constant<int, MR>{}) for a register block of mr rows (1-8; more: 8):
// the row count a tile's template takes, picked at run time.
template <typename F>
void with_rows(int mr, F&& f) {
  switch (mr) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// Rows [k0, k1) of one tile of NV x kNat float32 columns for MR rows of x, added to the
// partial sums in y (first: y starts at 0).
template <int MR, int NV>
void tile_f32(const MatmulArgs& a, const float* x, const float* w, float* y, int64_t k0,
              int64_t k1, bool first, int64_t ahead) {
  const int64_t K = a.K, N = a.N;
  vn acc[MR][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[m][v] = first ? vn{} : loadn(y + m * N + kNat * v);
  // A plain loop, not walk()'s lambda: accumulators captured by reference are stored
  // back to the stack every row (GCC keeps the escaped array in memory).
  const int lines = (NV * kNat + 15) / 16;
  const int64_t split = ahead > 0 ? std::min(k1, K - ahead) : k0;
  for (int64_t k = k0; k < k1; ++k) {
    if (k < split) prefetch_piece(reinterpret_cast<const char*>(w + (k + ahead) * N), lines);
    const float* row = w + k * N;
    vn wv[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) wv[v] = loadn(row + kNat * v);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const vn xb = broadcast(x + m * K + k);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[m][v] += xb * wv[v];
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) storen(y + m * N + kNat * v, acc[m][v]);
}

// Even / odd columns (e, o) back to column order: the first and second halves.
inline vn interleave_lo(vn e, vn o) {
#if KVJAX_NAT == 16
    return __builtin_shufflevector(e, o, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
#elif KVJAX_NAT == 8
    return __builtin_shufflevector(e, o, 0, 8, 1, 9, 2, 10, 3, 11);
#else
    return __builtin_shufflevector(e, o, 0, 4, 1, 5);
#endif
}
inline vn interleave_hi(vn e, vn o) {
#if KVJAX_NAT == 16
    return __builtin_shufflevector(e, o, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                   15, 31);
#elif KVJAX_NAT == 8
    return __builtin_shufflevector(e, o, 4, 12, 5, 13, 6, 14, 7, 15);
#else
    return __builtin_shufflevector(e, o, 2, 6, 3, 7);
#endif
}
// Column order (lo: the first kNat columns, hi: the next) to even / odd columns.
inline vn even_of(vn lo, vn hi) {
#if KVJAX_NAT == 16
    return __builtin_shufflevector(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                   30);
#elif KVJAX_NAT == 8
    return __builtin_shufflevector(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14);
#else
    return __builtin_shufflevector(lo, hi, 0, 2, 4, 6);
#endif
}
inline vn odd_of(vn lo, vn hi) {
#if KVJAX_NAT == 16
    return __builtin_shufflevector(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                   31);
#elif KVJAX_NAT == 8
    return __builtin_shufflevector(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15);
#else
    return __builtin_shufflevector(lo, hi, 1, 3, 5, 7);
#endif
}

// The same for one tile of 2 kNat bfloat16 columns (even / odd columns in two
// accumulators; the partial sums in y are in column order).
template <int MR>
void tile_bf16(const MatmulArgs& a, const float* x, const uint16_t* w, float* y, int64_t k0,
               int64_t k1, bool first, int64_t ahead) {
  const int64_t K = a.K, N = a.N;
  vn even[MR], odd[MR];
  for (int m = 0; m < MR; ++m) {
    if (first) {
      even[m] = odd[m] = vn{};
    } else {
      const vn lo = loadn(y + m * N), hi = loadn(y + m * N + kNat);
      even[m] = even_of(lo, hi);
      odd[m] = odd_of(lo, hi);
    }
  }
  const int64_t split = ahead > 0 ? std::min(k1, K - ahead) : k0;
  const int lines = (2 * kNat * 2 + 63) / 64;
  for (int64_t k = k0; k < k1; ++k) {
    if (k < split) prefetch_piece(reinterpret_cast<const char*>(w + (k + ahead) * N), lines);
    const vni raw = *reinterpret_cast<const vniu*>(w + k * N);
    const vni e = raw << 16, o = raw & static_cast<int32_t>(0xFFFF0000u);
    const vn we = reinterpret_cast<const vn&>(e), wo = reinterpret_cast<const vn&>(o);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const vn xb = broadcast(x + m * K + k);
      even[m] += xb * we;
      odd[m] += xb * wo;
    }
  }
  for (int m = 0; m < MR; ++m) {
    storen(y + m * N, interleave_lo(even[m], odd[m]));
    storen(y + m * N + kNat, interleave_hi(even[m], odd[m]));
  }
}

#if defined(__AVX512BF16__) && KVJAX_NAT == 16
#define KVJAX_MATMUL_DPBF16 1
// bfloat16 x and w on vdpbf16ps: a tile of 32 columns (one 64-byte row of w). Rows k and
// k + 1 of the tile, interleaved by unpacklo / unpackhi_epi16, are 16 (w[k][c], w[k+1][c])
// pairs each: within every 128-bit lane j, columns 8j..8j+3 (`lo`) and 8j+4..8j+7 (`hi`);
// x[m][k], x[m][k+1] are one 32-bit broadcast. A last odd row pairs with zeros.
inline vn dp_to_y0(vn lo, vn hi) {
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
}
inline vn dp_to_y1(vn lo, vn hi) {
  return __builtin_shufflevector(lo, hi, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                 30, 31);
}
inline vn dp_lo(vn y0, vn y1) {
  return __builtin_shufflevector(y0, y1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
}
inline vn dp_hi(vn y0, vn y1) {
  return __builtin_shufflevector(y0, y1, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                 31);
}

// x[k] and x[k + 1] (or x[k] and 0: `one`) in every 32-bit lane; the pair is one 4-byte
// load, which the compiler folds into vdpbf16ps as a broadcast operand.
inline __m512bh x_pair(const uint16_t* p, bool one) {
  uint32_t v;
  if (one) {
    v = p[0];
  } else {
    std::memcpy(&v, p, 4);
  }
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(v)));
}

// Weight rows r0, r1 (r1 zero and x's second k not read: `one`) into MR rows' sums.
// Always inlined, so the accumulators it takes by reference stay in registers.
template <int MR>
__attribute__((always_inline)) inline void dp_rows(__m512 (&lo)[MR], __m512 (&hi)[MR],
                                                   const uint16_t* x, int64_t K, __m512i r0,
                                                   __m512i r1, bool one) {
  const __m512bh wl = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(r0, r1));
  const __m512bh wh = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(r0, r1));
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    const __m512bh xb = x_pair(x + m * K, one);
    lo[m] = _mm512_dpbf16_ps(lo[m], xb, wl);
    hi[m] = _mm512_dpbf16_ps(hi[m], xb, wh);
  }
}

template <int MR>
void tile_dp(const MatmulArgs& a, const uint16_t* x, const uint16_t* w, float* y, int64_t k0,
             int64_t k1, bool first, int64_t ahead) {
  const int64_t K = a.K, N = a.N;
  __m512 lo[MR], hi[MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    if (first) {
      lo[m] = hi[m] = _mm512_setzero_ps();
    } else {
      const vn y0 = loadn(y + m * N), y1 = loadn(y + m * N + kNat);
      lo[m] = reinterpret_cast<__m512>(dp_lo(y0, y1));
      hi[m] = reinterpret_cast<__m512>(dp_hi(y0, y1));
    }
  }
  const int64_t split = ahead > 0 ? std::min(k1, K - ahead) : k0;
  int64_t k = k0;
  for (; k + 1 < k1; k += 2) {
    if (k < split) {
      prefetch_piece(reinterpret_cast<const char*>(w + (k + ahead) * N), 1);
      if (k + 1 < split) prefetch_piece(reinterpret_cast<const char*>(w + (k + 1 + ahead) * N), 1);
    }
    dp_rows<MR>(lo, hi, x + k, K, _mm512_loadu_si512(w + k * N),
                _mm512_loadu_si512(w + (k + 1) * N), false);
  }
  if (k < k1)
    dp_rows<MR>(lo, hi, x + k, K, _mm512_loadu_si512(w + k * N), _mm512_setzero_si512(), true);
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    // Casts by value: a reference into the accumulator arrays would keep them in memory.
    const vn l = (vn)lo[m], h = (vn)hi[m];
    storen(y + m * N, dp_to_y0(l, h));
    storen(y + m * N + kNat, dp_to_y1(l, h));
  }
}

#endif

template <int MR>
void tile_f32_nv(const MatmulArgs& a, int nv, const float* x, const float* w, float* y,
                 int64_t k0, int64_t k1, bool first, int64_t ahead) {
  switch (nv) {
    case 1: return tile_f32<MR, 1>(a, x, w, y, k0, k1, first, ahead);
    case 2: return tile_f32<MR, 2>(a, x, w, y, k0, k1, first, ahead);
    default: return tile_f32<MR, 3>(a, x, w, y, k0, k1, first, ahead);
  }
}

// Columns [c0, c1) (whole tiles of `width` columns, the last one possibly narrower but a
// multiple of the vector granule), all rows, panel by panel: rows [k0, k0 + panel) of
// the block, tile by tile, so the block's weight rows are read as contiguous pieces of
// (c1 - c0) columns; the sums wait in y between panels.
template <typename T>
void column_block(const MatmulArgs& a, int64_t c0, int64_t c1, int64_t width, int64_t panel) {
  const T* w = static_cast<const T*>(a.w);
  const int mr_max = std::is_same_v<T, float> ? kMaxRows : kMaxRowsBf16;
  for (int64_t k0 = 0; k0 < a.K; k0 += panel) {
    const int64_t k1 = std::min(a.K, k0 + panel);
    for (int64_t c = c0; c < c1; c += width) {
      const int64_t cols = std::min(width, c1 - c);
      for (int64_t m0 = 0; m0 < a.M; m0 += mr_max) {
        const int mr = static_cast<int>(std::min<int64_t>(mr_max, a.M - m0));
        // The first row group pulls the tile in; the others find it in L1 / L2.
        const int64_t ahead = m0 == 0 ? a.ahead : 0;
        float* y = a.y + m0 * a.N + c;
        const float* x = a.x + m0 * a.K;
        with_rows(mr, [&](auto rows) {
          constexpr int MR = decltype(rows)::value;
          if constexpr (std::is_same_v<T, float>) {
            tile_f32_nv<MR>(a, static_cast<int>(cols / kNat), x, w + c, y, k0, k1, k0 == 0,
                            ahead);
          } else {
            const uint16_t* wc = reinterpret_cast<const uint16_t*>(w + c);
#ifdef KVJAX_MATMUL_DPBF16
            if (a.xh != nullptr)
              return tile_dp<MR>(a, a.xh + m0 * a.K, wc, y, k0, k1, k0 == 0, ahead);
#endif
            tile_bf16<MR>(a, x, wc, y, k0, k1, k0 == 0, ahead);
          }
        });
      }
    }
  }
}

// One row of x (decode at batch 1): the walk above reads its tiles' rows as short pieces
// (a tile's width) far apart, and with one row of x there is no arithmetic to hide that
// behind. Here the item's columns are swept whole, kSweepRows rows of w at a time: each
// row of w is read as one contiguous piece of the item's width (the hardware prefetcher
// follows those streams), the sums wait in y (L1 / L2) between sweeps. Measured on cold
// weights against the tile walk: 1.45x on the LM head (512 x 32000), 1.2-1.35x on 1408
// and 512 columns (AVX2 and AVX-512 builds alike).
constexpr int kSweepRows = 16;
constexpr int kSweepUnroll = 4;  // vectors (float32) or vector pairs (bf16) per step

template <typename T>
void sweep_columns(const MatmulArgs& a, int64_t c0, int64_t c1) {
  const float* x = a.x;
  float* y = a.y;
  for (int64_t k0 = 0; k0 < a.K; k0 += kSweepRows) {
    const int64_t kp = std::min<int64_t>(kSweepRows, a.K - k0);
    const bool first = k0 == 0;
    if constexpr (std::is_same_v<T, float>) {
      const float* w = static_cast<const float*>(a.w) + k0 * a.N;
      int64_t c = c0;
      for (; c + kSweepUnroll * kNat <= c1; c += kSweepUnroll * kNat) {
        vn acc[kSweepUnroll];
#pragma GCC unroll 4
        for (int u = 0; u < kSweepUnroll; ++u) acc[u] = first ? vn{} : loadn(y + c + u * kNat);
        for (int64_t i = 0; i < kp; ++i) {
          const vn xb = broadcast(x + k0 + i);
#pragma GCC unroll 4
          for (int u = 0; u < kSweepUnroll; ++u) acc[u] += xb * loadn(w + i * a.N + c + u * kNat);
        }
#pragma GCC unroll 4
        for (int u = 0; u < kSweepUnroll; ++u) storen(y + c + u * kNat, acc[u]);
      }
      for (; c < c1; c += kNat) {
        vn acc = first ? vn{} : loadn(y + c);
        for (int64_t i = 0; i < kp; ++i) acc += broadcast(x + k0 + i) * loadn(w + i * a.N + c);
        storen(y + c, acc);
      }
    } else {
      // bf16: a vector load holds 2 kNat columns; even and odd columns sum apart and are
      // interleaved back at the store (as tile_bf16).
      const uint16_t* w = reinterpret_cast<const uint16_t*>(a.w) + k0 * a.N;
      for (int64_t c = c0; c < c1; c += 2 * kNat) {
        vn even, odd;
        if (first) {
          even = odd = vn{};
        } else {
          const vn lo = loadn(y + c), hi = loadn(y + c + kNat);
          even = even_of(lo, hi);
          odd = odd_of(lo, hi);
        }
        for (int64_t i = 0; i < kp; ++i) {
          const vni raw = *reinterpret_cast<const vniu*>(w + i * a.N + c);
          const vni e = raw << 16, o = raw & static_cast<int32_t>(0xFFFF0000u);
          const vn xb = broadcast(x + k0 + i);
          even += xb * reinterpret_cast<const vn&>(e);
          odd += xb * reinterpret_cast<const vn&>(o);
        }
        storen(y + c, interleave_lo(even, odd));
        storen(y + c + kNat, interleave_hi(even, odd));
      }
    }
  }
}

// Columns [c0, N) that no vector tile covers: a scalar loop, row by row of w.
template <typename T>
void column_tail(const MatmulArgs& a, int64_t c0) {
  const T* w = static_cast<const T*>(a.w);
  const int64_t n = a.N - c0;
  if (n <= 0) return;
  std::vector<float> acc(a.M * n, 0.0f);
  for (int64_t k = 0; k < a.K; ++k) {
    const T* row = w + k * a.N + c0;
    for (int64_t m = 0; m < a.M; ++m) {
      const float xv = a.x[m * a.K + k];
      for (int64_t j = 0; j < n; ++j) acc[m * n + j] += xv * to_float(row[j]);
    }
  }
  for (int64_t m = 0; m < a.M; ++m)
    std::memcpy(a.y + m * a.N + c0, acc.data() + m * n, n * sizeof(float));
}

template <typename T>
void run(ffi::ThreadPool* pool, const MatmulArgs& a, int64_t tile_vectors, int64_t block,
         int64_t panel) {
  if (tile_vectors <= 0) tile_vectors = kTileVectors;
  // Vector granule and tile width in columns.
  const int64_t granule = std::is_same_v<T, float> ? kNat : 2 * kNat;
  const int64_t width = std::is_same_v<T, float> ? kNat * tile_vectors : granule;
  const int64_t covered = a.N / granule * granule;
  // Column blocks of whole tiles, at most `block` columns (<= 0: 16 tiles) and about 4
  // per worker when N is small, so both cores get work for every N the models have.
  const int64_t workers = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t even_split = (covered + 4 * workers - 1) / (4 * workers);
  int64_t bw = std::min(block > 0 ? block : 16 * width, even_split);
  bw = std::max<int64_t>(width, (bw + width - 1) / width * width);
  const int64_t items = (covered + bw - 1) / bw;
  auto item = [&](int64_t i, int) {
    if (i == items) return column_tail<T>(a, covered);
    column_block<T>(a, i * bw, std::min(covered, (i + 1) * bw), width, panel > 0 ? panel : a.K);
  };
  const int64_t total = items + (covered < a.N ? 1 : 0);
  // Small weights (tens of microseconds of reading) stay on the caller: waking a helper
  // costs about as much, and a helper preempted by another process stalls the call.
  if (a.K * a.N * static_cast<int64_t>(sizeof(T)) < kMinParallelBytes) {
    for (int64_t i = 0; i < total; ++i) item(i, 0);
  } else {
    parallel_for(pool, total, item);
  }
}

// The one-row path: sweep_columns over contiguous column ranges, two per worker (one per
// worker measured about the same; four 0.9x: narrower pieces of each row).
template <typename T>
void run_sweep(ffi::ThreadPool* pool, const MatmulArgs& a) {
  const int64_t granule = std::is_same_v<T, float> ? kNat : 2 * kNat;
  const int64_t covered = a.N / granule * granule;
  const int64_t workers = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t items = std::max<int64_t>(1, std::min(2 * workers, covered / (4 * granule)));
  const int64_t per = (covered / granule + items - 1) / items * granule;
  auto item = [&](int64_t i, int) {
    if (i == items) return column_tail<T>(a, covered);
    const int64_t c0 = i * per, c1 = std::min(covered, c0 + per);
    if (c0 < c1) sweep_columns<T>(a, c0, c1);
  };
  const int64_t total = items + (covered < a.N ? 1 : 0);
  if (a.K * a.N * static_cast<int64_t>(sizeof(T)) < kMinParallelBytes) {
    for (int64_t i = 0; i < total; ++i) item(i, 0);
  } else {
    parallel_for(pool, total, item);
  }
}

// ---------------------------------------------------------------------------------------
// Many rows (prefill, training): a packed, cache-blocked GEMM. The op is compute-bound
// there, so the work is keeping the FMA units busy: w is packed once per call into panels
// of kPackCols columns ([K / kc][N / kPackCols][kc][kPackCols], bf16 widened, the last
// panel zero-padded), shared by all workers; each work item is a block of kPackRowBlock
// rows of x, packed kc columns at a time into row panels ([kPackRows][kc] transposed to
// [kc][kPackRows], zero-padded) that stay in L2 while every column panel of w (in L3 or
// L2) passes through one register block of kPackRows x kPackVecs vectors. The register
// block: 12 x 2 zmm on AVX-512 (24 accumulators of its 32 registers), 6 x 2 ymm on AVX2
// (12 of 16), 4 x 2 elsewhere.

#if KVJAX_NAT == 16
constexpr int kPackRows = 12;
#elif KVJAX_NAT == 8
constexpr int kPackRows = 6;
#else
constexpr int kPackRows = 4;
#endif
constexpr int kPackVecs = 2;
constexpr int kPackCols = kPackVecs * kNat;
constexpr int64_t kPackRowBlock = 8 * kPackRows;  // rows of x per work item

// One register block: rows [0, rows) x columns [0, cols) of y (row stride ldy) from the
// packed x panel a ([kc][kPackRows]) and w panel b ([kc][kPackCols]); adds to y unless
// `first`.
template <int MR>
inline void packed_block(int64_t kc, const float* __restrict a, const float* __restrict b,
                         float* y, int64_t ldy, bool first, int rows, int cols) {
  vn acc[MR][kPackVecs];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < kPackVecs; ++v) acc[m][v] = vn{};
#pragma GCC unroll 2
  for (int64_t k = 0; k < kc; ++k) {
    vn bv[kPackVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kPackVecs; ++v) bv[v] = loadn(b + k * kPackCols + v * kNat);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const vn xb = broadcast(a + k * MR + m);
#pragma GCC unroll 4
      for (int v = 0; v < kPackVecs; ++v) acc[m][v] += xb * bv[v];
    }
  }
  if (rows == MR && cols == kPackCols) {
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int v = 0; v < kPackVecs; ++v) {
        float* p = y + m * ldy + v * kNat;
        storen(p, first ? acc[m][v] : acc[m][v] + loadn(p));
      }
    return;
  }
  alignas(64) float tile[MR * kPackCols];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kPackVecs; ++v) storen(tile + m * kPackCols + v * kNat, acc[m][v]);
  for (int m = 0; m < rows; ++m)
    for (int j = 0; j < cols; ++j)
      y[m * ldy + j] = first ? tile[m * kPackCols + j] : y[m * ldy + j] + tile[m * kPackCols + j];
}

// w rows [k0, k0 + kc), column panel p, widened into dst [kc][kPackCols] (zero-padded).
template <typename T>
void pack_w(const MatmulArgs& a, int64_t k0, int64_t kc, int64_t p, float* dst) {
  const T* w = static_cast<const T*>(a.w);
  const int64_t c0 = p * kPackCols, cols = std::min<int64_t>(kPackCols, a.N - c0);
  for (int64_t k = 0; k < kc; ++k) {
    const T* row = w + (k0 + k) * a.N + c0;
    float* out = dst + k * kPackCols;
    if (cols == kPackCols) {
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(out, row, kPackCols * sizeof(float));
      } else {
        widen_bf16(reinterpret_cast<const uint16_t*>(row), out, kPackCols);
      }
    } else {
      for (int64_t j = 0; j < kPackCols; ++j) out[j] = j < cols ? to_float(row[j]) : 0.0f;
    }
  }
}

template <typename T>
void run_packed(ffi::ThreadPool* pool, const MatmulArgs& a, int64_t kc_max) {
  const int64_t M = a.M, K = a.K, N = a.N;
  const int64_t kc_step = std::max<int64_t>(1, kc_max);
  const int64_t panels = (N + kPackCols - 1) / kPackCols;
  const int64_t kblocks = (K + kc_step - 1) / kc_step;
  // Packed w: for k block kb, panel p at ((kb * panels + p) * kc_step) * kPackCols.
  thread_local Scratch wbuf;
  float* wp = wbuf.get(kblocks * panels * kc_step * kPackCols);
  parallel_for(pool, kblocks * panels, [&](int64_t i, int) {
    const int64_t kb = i / panels, p = i % panels;
    const int64_t k0 = kb * kc_step, kc = std::min(kc_step, K - k0);
    pack_w<T>(a, k0, kc, p, wp + (kb * panels + p) * kc_step * kPackCols);
  });
  const int64_t items = (M + kPackRowBlock - 1) / kPackRowBlock;
  parallel_for(pool, items, [&](int64_t item, int) {
    thread_local Scratch xbuf;
    const int64_t r0 = item * kPackRowBlock, nrows = std::min(kPackRowBlock, M - r0);
    const int64_t groups = (nrows + kPackRows - 1) / kPackRows;
    float* xp = xbuf.get(groups * kc_step * kPackRows);
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const int64_t k0 = kb * kc_step, kc = std::min(kc_step, K - k0);
      // x rows [r0, r0 + nrows), columns [k0, k0 + kc) as [groups][kc][kPackRows].
      for (int64_t g = 0; g < groups; ++g) {
        float* dst = xp + g * kc * kPackRows;
        for (int m = 0; m < kPackRows; ++m) {
          const int64_t r = r0 + g * kPackRows + m;
          if (r < r0 + nrows) {
            const float* src = a.x + r * K + k0;
            for (int64_t k = 0; k < kc; ++k) dst[k * kPackRows + m] = src[k];
          } else {
            for (int64_t k = 0; k < kc; ++k) dst[k * kPackRows + m] = 0.0f;
          }
        }
      }
      for (int64_t p = 0; p < panels; ++p) {
        const float* b = wp + (kb * panels + p) * kc_step * kPackCols;
        const int cols = static_cast<int>(std::min<int64_t>(kPackCols, N - p * kPackCols));
        for (int64_t g = 0; g < groups; ++g) {
          const int rows = static_cast<int>(std::min<int64_t>(kPackRows, nrows - g * kPackRows));
          packed_block<kPackRows>(kc, xp + g * kc * kPackRows, b,
                                  a.y + (r0 + g * kPackRows) * N + p * kPackCols, N, kb == 0,
                                  rows, cols);
        }
      }
    }
  });
}

#ifdef KVJAX_MATMUL_DPBF16
// The many-row GEMM on vdpbf16ps (bfloat16 x and w): as run_packed, but w is packed as
// pairs of its rows, (w[k][c], w[k+1][c]) in one 32-bit lane ([K / kc][N / kPackCols]
// [kc / 2][kPackCols] lanes, nothing widened), and x is read as pairs (x[r][k], x[r][k+1]),
// one 32-bit word per row and pair (row m of a register block at x + m * ldx words), so a
// register block does two k's per instruction. An odd last k pairs with zeros.
inline uint32_t bf16_pair(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
}

template <int MR>
inline void packed_block_dp(int64_t kp, const uint32_t* __restrict x, int64_t ldx,
                            const uint32_t* __restrict b, float* y, int64_t ldy, bool first,
                            int rows, int cols) {
  __m512 acc[MR][kPackVecs];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < kPackVecs; ++v) acc[m][v] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t k = 0; k < kp; ++k) {
    __m512bh bv[kPackVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kPackVecs; ++v)
      bv[v] = (__m512bh)_mm512_loadu_si512(b + k * kPackCols + v * kNat);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + k]));
#pragma GCC unroll 4
      for (int v = 0; v < kPackVecs; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb, bv[v]);
    }
  }
  if (rows == MR && cols == kPackCols) {
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int v = 0; v < kPackVecs; ++v) {
        float* p = y + m * ldy + v * kNat;
        const vn r = (vn)acc[m][v];
        storen(p, first ? r : r + loadn(p));
      }
    return;
  }
  alignas(64) float tile[MR * kPackCols];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < kPackVecs; ++v) storen(tile + m * kPackCols + v * kNat, (vn)acc[m][v]);
  for (int m = 0; m < rows; ++m)
    for (int j = 0; j < cols; ++j)
      y[m * ldy + j] = first ? tile[m * kPackCols + j] : y[m * ldy + j] + tile[m * kPackCols + j];
}

void run_packed_dp(ffi::ThreadPool* pool, const MatmulArgs& a, int64_t kc_max) {
  const int64_t M = a.M, K = a.K, N = a.N;
  const int64_t kc_step = std::max<int64_t>(2, (kc_max + 1) / 2 * 2);  // even: whole pairs
  const int64_t kp_step = kc_step / 2;
  const int64_t panels = (N + kPackCols - 1) / kPackCols;
  const int64_t kblocks = (K + kc_step - 1) / kc_step;
  const uint16_t* w = static_cast<const uint16_t*>(a.w);
  // Packed w: for k block kb, panel p at ((kb * panels + p) * kp_step) * kPackCols lanes.
  thread_local Scratch wbuf;
  uint32_t* wp = reinterpret_cast<uint32_t*>(wbuf.get(kblocks * panels * kp_step * kPackCols));
  parallel_for(pool, kblocks * panels, [&](int64_t i, int) {
    const int64_t kb = i / panels, p = i % panels;
    const int64_t k0 = kb * kc_step, kc = std::min(kc_step, K - k0);
    const int64_t c0 = p * kPackCols, cols = std::min<int64_t>(kPackCols, N - c0);
    uint32_t* dst = wp + (kb * panels + p) * kp_step * kPackCols;
    for (int64_t q = 0; q < (kc + 1) / 2; ++q) {
      const uint16_t* r0 = w + (k0 + 2 * q) * N + c0;
      const uint16_t* r1 = 2 * q + 1 < kc ? r0 + N : nullptr;
      uint32_t* out = dst + q * kPackCols;
      if (cols == kPackCols && r1 != nullptr) {
#pragma GCC unroll 4
        for (int v = 0; v < kPackCols / 32; ++v) {
          const __m512i x0 = _mm512_loadu_si512(r0 + 32 * v), x1 = _mm512_loadu_si512(r1 + 32 * v);
          // unpack pairs columns within 128-bit lanes; permute the lanes back to order.
          const __m512i lo = _mm512_unpacklo_epi16(x0, x1), hi = _mm512_unpackhi_epi16(x0, x1);
          const __m512i i0 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
          const __m512i i1 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
          _mm512_storeu_si512(out + 32 * v, _mm512_permutex2var_epi64(lo, i0, hi));
          _mm512_storeu_si512(out + 32 * v + 16, _mm512_permutex2var_epi64(lo, i1, hi));
        }
      } else {
        for (int64_t j = 0; j < kPackCols; ++j)
          out[j] = j < cols ? bf16_pair(r0[j], r1 != nullptr ? r1[j] : 0) : 0;
      }
    }
  });
  // Work items: a block of rows x a range of column panels, at least 4 per worker where
  // the shape allows (a prefill chunk of 64 rows is one row block), and a multiple of the
  // workers where the panels allow (9 items on 2 workers left one idle a ninth of the call).
  const int64_t row_items = (M + kPackRowBlock - 1) / kPackRowBlock;
  const int64_t workers = std::max<int64_t>(1, std::thread::hardware_concurrency());
  int64_t col_items =
      std::min(panels, std::max<int64_t>(1, (4 * workers + row_items - 1) / row_items));
  while (col_items < panels && row_items * col_items % workers != 0) ++col_items;
  const int64_t per = (panels + col_items - 1) / col_items;
  // With K even, x's rows are read in place: the pair (x[r][k], x[r][k + 1]) of an even k
  // is the 32-bit word at x[r] + k. A group of fewer than kPackRows rows (the last of
  // x), or any group with K odd, is staged as [kPackRows][kp] words, zero-padded.
  const bool in_place = K % 2 == 0;
  constexpr int64_t kGroups = kPackRowBlock / kPackRows;
  parallel_for(pool, row_items * col_items, [&](int64_t item, int) {
    thread_local Scratch xbuf;
    const int64_t ri = item / col_items, p0 = item % col_items * per;
    const int64_t p1 = std::min(panels, p0 + per);
    if (p0 >= p1) return;
    const int64_t r0 = ri * kPackRowBlock, nrows = std::min(kPackRowBlock, M - r0);
    const int64_t groups = (nrows + kPackRows - 1) / kPackRows;
    uint32_t* xs = reinterpret_cast<uint32_t*>(xbuf.get(groups * kPackRows * kp_step));
    const uint32_t* gx[kGroups];
    int64_t gld[kGroups];
    int grows[kGroups];
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const int64_t k0 = kb * kc_step, kc = std::min(kc_step, K - k0), kp = (kc + 1) / 2;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r = r0 + g * kPackRows;
        grows[g] = static_cast<int>(std::min<int64_t>(kPackRows, nrows - g * kPackRows));
        if (in_place && grows[g] == kPackRows) {
          gx[g] = reinterpret_cast<const uint32_t*>(a.xh + r * K + k0);
          gld[g] = K / 2;
          continue;
        }
        uint32_t* dst = xs + g * kPackRows * kp_step;
        for (int m = 0; m < kPackRows; ++m) {
          uint32_t* d = dst + m * kp_step;
          if (m >= grows[g]) {
            std::fill(d, d + kp, 0u);
            continue;
          }
          const uint16_t* src = a.xh + (r + m) * K + k0;
          for (int64_t q = 0; q < kp; ++q)
            d[q] = bf16_pair(src[2 * q], 2 * q + 1 < kc ? src[2 * q + 1] : 0);
        }
        gx[g] = dst;
        gld[g] = kp_step;
      }
      for (int64_t p = p0; p < p1; ++p) {
        const uint32_t* b = wp + (kb * panels + p) * kp_step * kPackCols;
        const int cols = static_cast<int>(std::min<int64_t>(kPackCols, N - p * kPackCols));
        for (int64_t g = 0; g < groups; ++g)
          packed_block_dp<kPackRows>(kp, gx[g], gld[g], b,
                                     a.y + (r0 + g * kPackRows) * N + p * kPackCols, N, kb == 0,
                                     grows[g], cols);
      }
    }
  });
}
#endif

// y[0, n) rounded to bfloat16 (to nearest, ties to even) and kept as float32: the values
// a bfloat16 result widened back holds, without that round trip through a bfloat16
// array (the `widen` of matmul.py: bf16 logits wanted as float32). Used for bfloat16 x
// and w only, whose NaNs (and the sums they make) have no payload in the low 16 bits,
// so adding the rounding bias keeps them NaN; infinities stay infinite.
void round_to_bf16(float* y, int64_t n) {
  typedef uint32_t vu __attribute__((vector_size(4 * kNat)));  // unsigned: adds wrap
  int64_t i = 0;
  for (; i + kNat <= n; i += kNat) {
    vu b;
    std::memcpy(&b, y + i, sizeof b);
    b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(y + i, &b, sizeof b);
  }
  for (; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, y + i, 4);
    b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(y + i, &b, 4);
  }
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::Buffer<ffi::S32> layer, int64_t tile_vectors, int64_t block,
                      int64_t panel, int64_t ahead, int64_t sweep, int64_t packed,
                      int64_t round_bf16, ffi::ResultBuffer<ffi::F32> y) {
  // w is [K, N], or stacked layers [L, K, N] of which `layer` (clamped) is used in place.
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const size_t wr = wd.size();
  if (xd.size() != 2 || (wr != 2 && wr != 3) || yd.size() != 2 || xd[1] != wd[wr - 2] ||
      yd[0] != xd[0] || yd[1] != wd[wr - 1])
    return ffi::Error::InvalidArgument(
        "kvjax matmul: expected x [M, K], w [K, N] or [layers, K, N] and y [M, N]");
  if (wr == 3 && wd[0] <= 0)
    return ffi::Error::InvalidArgument("kvjax matmul: stacked weights with no layers");
  if (tile_vectors < 0 || tile_vectors > 3)
    return ffi::Error::InvalidArgument("kvjax matmul: tile_vectors must be 0 (the build's), 1, 2 or 3");
  const auto dt = w.element_type(), xt = x.element_type();
  if (xt != ffi::F32 && xt != ffi::BF16)
    return ffi::Error::InvalidArgument("kvjax matmul: x must be float32 or bfloat16");
  MatmulArgs a;
  a.xh = nullptr;
  if (xt == ffi::F32) {
    a.x = static_cast<const float*>(x.untyped_data());
  } else {
    const uint16_t* xh = static_cast<const uint16_t*>(x.untyped_data());
    bool widen = true;
#ifdef KVJAX_MATMUL_DPBF16
    if (dt == ffi::BF16) a.xh = xh;
    widen = !(dt == ffi::BF16 && packed > 0);  // the packed vdpbf16ps GEMM reads only xh
#endif
    // Widened once per call for the float32 paths (with bf16 w, the tail columns and the
    // one-row sweep of the few-row kernel).
    a.x = nullptr;
    if (widen) {
      thread_local Scratch xbuf;
      float* xf = xbuf.get(xd[0] * xd[1]);
      widen_bf16(xh, xf, xd[0] * xd[1]);
      a.x = xf;
    }
  }
  a.y = y->typed_data();
  a.M = xd[0];
  a.K = xd[1];
  a.N = wd[wr - 1];
  const int64_t l = wr == 3 ? clamp_index(layer.typed_data()[0], wd[0]) : 0;
  const int64_t esize = dt == ffi::BF16 ? 2 : 4;
  a.w = static_cast<const char*>(w.untyped_data()) + l * a.K * a.N * esize;
  a.ahead = ahead;
  if (a.M == 0 || a.N == 0) return ffi::Error::Success();
  if (a.K == 0) {
    std::fill(a.y, a.y + a.M * a.N, 0.0f);
    return ffi::Error::Success();
  }
  if (dt != ffi::F32 && dt != ffi::BF16)
    return ffi::Error::InvalidArgument("kvjax matmul: w must be float32 or bfloat16");
  if (packed > 0) {
#ifdef KVJAX_MATMUL_DPBF16
    if (a.xh != nullptr) {
      run_packed_dp(&pool, a, packed);
    } else
#endif
    if (dt == ffi::F32) {
      run_packed<float>(&pool, a, packed);
    } else {
      run_packed<Bf16>(&pool, a, packed);
    }
  } else if (sweep != 0 && a.M == 1) {
    if (dt == ffi::F32) {
      run_sweep<float>(&pool, a);
    } else {
      run_sweep<Bf16>(&pool, a);
    }
  } else if (dt == ffi::F32) {
    run<float>(&pool, a, tile_vectors, block, panel);
  } else {
    run<Bf16>(&pool, a, tile_vectors, block, panel);
  }
  if (round_bf16 != 0) round_to_bf16(a.y, a.M * a.N);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kvjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxMatmul, kvjax::MatmulImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x [M, K]
                                  .Arg<xla::ffi::AnyBuffer>()              // w [(L,) K, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // layer
                                  .Attr<int64_t>("tile_vectors")
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("panel")
                                  .Attr<int64_t>("ahead")
                                  .Attr<int64_t>("sweep")
                                  .Attr<int64_t>("packed")
                                  .Attr<int64_t>("round_bf16")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // y [M, N]
