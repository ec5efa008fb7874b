// CPU flash attention (forward, float32) as an XLA FFI custom call: pallas_kernels.cpu.flash_attention.
//
//   q [B, T, H, E], k / v [B, S, Kh, E] (GQA: query head h uses KV head h / (H / Kh)),
//   q_offset int32 [B], kv_len int32 [B], attribute scale  ->  out [B, T, H, E]            (CpuFlashAttention)
//   the same and k_positions int32 [B, S]                    ->  out                         (CpuFlashAttentionAt)
//   the same and weights float32 [B, T]  ->  out, received [B, Kh, nqb, S]            (CpuFlashAttentionReceivedAt)
//
// received[b, kh, qb, s] is the attention key slot s gets from query block qb's queries, each query's
// probabilities weighted by weights[b, t] and summed over the G query heads of KV head kh (H2O's accumulated
// attention, without materialising the probabilities): the caller sums over qb. A second pass over the block's
// keys recomputes the scores once each row's maximum and sum are final.
//
// Query t of sequence b sits at position q_offset[b] + t; key slot s holds position s (CpuFlashAttention) or
// k_positions[b, s] (CpuFlashAttentionAt: a ring of cached tokens and a chunk, an eviction cache; -1 is an empty
// slot) and is filled iff s < kv_len[b] (and its position is >= 0). A query at position p sees a filled slot iff
// the slot's position is <= p; a query that sees no key gives zeros. Slots past kv_len are never read, nor, over a
// contiguous cache, slots past the last query position.
//
// One work item is (b, KV head, block of `block_q` queries); its rows are the block's queries times the G
// query heads of that KV head, so each K / V block is read once for all G heads. Everything is kept
// "row-major in lanes": Q^T [E][R], scores S^T [keys][R], O^T [E][R] with the R rows along the SIMD lanes,
// so both matmuls broadcast K / V elements straight from the cache (no packing of K or V) and the online
// softmax is purely vertical (no horizontal reductions). exp2 is a polynomial with scale * log2(e) folded
// into Q. Items are spread over XLA's intra-op thread pool (XLA_FFI_ThreadPool_Schedule) plus the caller, no
// thread of its own (spinning OpenMP threads would take the cores from XLA's). Built with -march=native: the
// vector extensions below are AVX-512 registers where the host has them, pairs of AVX2 ones (or what the
// target has) elsewhere.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <numeric>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;                                    // floats per vector (one AVX-512 register)
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }  // vbroadcastss
inline vf load(const float* p) { return *reinterpret_cast<const vf*>(p); }  // 64-byte aligned scratch only
inline void store(float* p, vf x) { *reinterpret_cast<vf*>(p) = x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// 2^x for x <= 0 (x = -inf gives 0), relative error ~2e-7: 2^round(x) * poly(x - round(x)).
inline vf exp2_poly(vf f) {                                   // 2^f for f in [-0.5, 0.5]
  vf p = splat(1.5403530e-4f);
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  return p * f + 1.0f;
}
#ifdef __AVX512F__
inline vf exp2_neg(vf x) {
  const vf c = vmax(x, splat(-200.0f));                       // 2^-200 rounds to 0
  const vf n = (vf)_mm512_roundscale_ps((__m512)c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return (vf)_mm512_scalef_ps((__m512)exp2_poly(c - n), (__m512)n);
}
#else
inline vf exp2_neg(vf x) {
  const vf magic = splat(12582912.0f);                        // 1.5 * 2^23: adding it rounds to an integer
  x = x > splat(-127.0f) ? x : splat(-127.0f);
  const vf t = x + magic;
  const vi n = (vi)t - 0x4B400000;                            // round(x) as an integer, in [-127, 0]
  return exp2_poly(x - (t - magic)) * (vf)((n + 127) << 23);  // n = -127 gives +0
}
#endif

struct Problem {
  const float *q, *k, *v;
  const int32_t *q_offset, *kv_len;
  const int32_t* k_pos;                                       // [B, S] key positions, or nullptr: slot = position
  float* out;
  int64_t B, T, H, S, Kh, E, G;
  int block_q, block_k;
  float q_scale;                                              // scale * log2(e)
  const float* weights = nullptr;                             // [B, T]: with `received`, each query's weight
  float* received = nullptr;                                  // [B, Kh, nqb, S], or nullptr: not wanted
  int64_t nqb = 0;                                            // query blocks
  int64_t rows_padded() const { return (block_q * G + kLanes - 1) / kLanes * kLanes; }
};

// Per-thread scratch, 64-byte aligned.
struct Scratch {
  struct Free { void operator()(void* p) const { std::free(p); } };
  std::unique_ptr<float, Free> buf;
  size_t size = 0;
  float *qt, *ot, *s, *m, *l, *alpha, *bmax, *weight;
  int32_t* pos;

  void ensure(const Problem& p) {
    const int64_t R = p.rows_padded(), bk8 = (p.block_k + 7) / 8 * 8;
    const size_t need = 2 * p.E * R + bk8 * R + 6 * R;
    if (need > size) {
      buf.reset(static_cast<float*>(std::aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64)));
      size = need;
    }
    qt = buf.get();
    ot = qt + p.E * R;
    s = ot + p.E * R;
    m = s + bk8 * R;
    l = m + R;
    alpha = l + R;
    bmax = alpha + R;
    weight = bmax + R;
    pos = reinterpret_cast<int32_t*>(weight + R);
  }
};

constexpr int32_t kNever = std::numeric_limits<int32_t>::max();  // the position of a key no query sees

// S^T[i][rows] = sum_e K_i[e] * Q^T[e][rows] for 8 keys and RT row vectors; when `mask` is set, scores of keys
// whose position kp[i] is after a row's position become -inf (kNever: every row). Folds the tile's maxima into
// bmax[rows].
template <int RT>
inline void qk_tile(const float* __restrict qt, int64_t R, const float* const* kr, int64_t E, float* __restrict s,
                    float* __restrict bmax, bool mask, const int32_t* kp, const int32_t* pos) {
  vf acc[8][RT] = {};
  for (int64_t e = 0; e < E; ++e) {
    vf qv[RT];
#pragma GCC unroll 4
    for (int j = 0; j < RT; ++j) qv[j] = load(qt + e * R + j * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const vf kb = splat(kr[i][e]);
#pragma GCC unroll 4
      for (int j = 0; j < RT; ++j) acc[i][j] += kb * qv[j];
    }
  }
  if (mask) {
    const vf neg_inf = splat(-std::numeric_limits<float>::infinity());
#pragma GCC unroll 4
    for (int j = 0; j < RT; ++j) {
      const vi pj = *reinterpret_cast<const vi*>(pos + j * kLanes);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) acc[i][j] = (vi{} + kp[i]) > pj ? neg_inf : acc[i][j];
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < RT; ++j) {
    vf m = load(bmax + j * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      m = vmax(m, acc[i][j]);
      store(s + i * R + j * kLanes, acc[i][j]);
    }
    store(bmax + j * kLanes, m);
  }
}

// O^T[e0 + i][rows] = alpha[rows] * O^T[e0 + i][rows] + sum_s V[s][e0 + i] * P^T[s][rows], 8 e's, RT row vectors.
template <int RT>
inline void pv_tile(float* __restrict ot, int64_t R, const float* __restrict p, const float* v, int64_t v_stride,
                    int64_t n, const float* __restrict alpha) {
  vf acc[8][RT], a[RT];
#pragma GCC unroll 4
  for (int j = 0; j < RT; ++j) a[j] = load(alpha + j * kLanes);
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < RT; ++j) acc[i][j] = load(ot + i * R + j * kLanes) * a[j];
  for (int64_t s = 0; s < n; ++s) {
    vf pv[RT];
#pragma GCC unroll 4
    for (int j = 0; j < RT; ++j) pv[j] = load(p + s * R + j * kLanes);
    const float* vs = v + s * v_stride;
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const vf vb = splat(vs[i]);
#pragma GCC unroll 4
      for (int j = 0; j < RT; ++j) acc[i][j] += vb * pv[j];
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < RT; ++j) store(ot + i * R + j * kLanes, acc[i][j]);
}

template <int N>
using Int = std::integral_constant<int, N>;

// Calls f(Int<RT>, first row vector) over the RV row vectors in groups of RT <= 3.
template <typename F>
inline void for_row_groups(int64_t RV, F&& f) {
  int64_t j = 0;
  for (; j + 3 <= RV; j += 3) f(Int<3>(), j);
  if (RV - j == 2) f(Int<2>(), j);
  if (RV - j == 1) f(Int<1>(), j);
}

// sum over the lanes of x
inline float hsum(vf x) {
  float total = 0.0f;
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) total += x[i];
  return total;
}

void run_item(const Problem& p, Scratch& w, int64_t b, int64_t kh, int64_t qb) {
  const int64_t E = p.E, G = p.G, R = p.rows_padded(), RV = R / kLanes;
  const int64_t t0 = qb * p.block_q, nt = std::min<int64_t>(p.block_q, p.T - t0), rows = nt * G;
  const int64_t q_off = p.q_offset[b], kv_len = p.kv_len[b];
  const int64_t max_pos = q_off + t0 + nt - 1;
  const int32_t* k_pos = p.k_pos ? p.k_pos + b * p.S : nullptr;
  // Keys [0, s_end) are read, no others: over a contiguous cache none past the last query's position.
  const int64_t s_end = k_pos ? kv_len : std::min(kv_len, max_pos + 1);
  auto out_row = [&](int64_t r) { return p.out + ((b * p.T + t0 + r / G) * p.H + kh * G + r % G) * E; };
  float* received = p.received ? p.received + ((b * p.Kh + kh) * p.nqb + qb) * p.S : nullptr;
  if (received) std::fill_n(received, p.S, 0.0f);

  if (s_end <= 0) {
    for (int64_t r = 0; r < rows; ++r) std::fill_n(out_row(r), E, 0.0f);
    return;
  }
  // Q^T, scaled; padding rows are zero and take the last real row's position.
  for (int64_t r = 0; r < R; ++r) {
    const int64_t rr = std::min(r, rows - 1);
    w.pos[r] = static_cast<int32_t>(q_off + t0 + rr / G);
    const float* src = p.q + ((b * p.T + t0 + rr / G) * p.H + kh * G + rr % G) * E;
    const float f = r < rows ? p.q_scale : 0.0f;
    for (int64_t e = 0; e < E; ++e) w.qt[e * R + r] = src[e] * f;
  }
  std::fill_n(w.ot, E * R, 0.0f);
  std::fill_n(w.m, R, -std::numeric_limits<float>::infinity());
  std::fill_n(w.l, R, 0.0f);
  std::fill_n(w.bmax, R, -std::numeric_limits<float>::infinity());

  const int64_t kv_stride = p.Kh * E;
  const float* k_base = p.k + (b * p.S * p.Kh + kh) * E;
  const float* v_base = p.v + (b * p.S * p.Kh + kh) * E;
  const vf neg_inf = splat(-std::numeric_limits<float>::infinity());

  // Scores S^T of every key block for one group of up to 3 row vectors at a time (so that its Q^T, S^T and O^T
  // stay in L1 next to the K / V block), each handed to tile(rt, j0, s0, n, n8): keys s0 .. s0 + n - 1 (n8: n
  // rounded up to the tile of 8, the extra keys masked).
  auto for_each_tile = [&](auto&& tile) {
    for (int64_t s0 = 0; s0 < s_end; s0 += p.block_k) {
      // Keys at explicit positions: the block's lowest and highest position, and whether it has an empty slot, so
      // that a group skips a block it sees none of (a chunk's keys after its queries) and masks only where needed.
      int32_t block_lo = kNever, block_hi = -1;
      bool block_has_empty = false;
      for (int64_t i = s0; k_pos && i < std::min(s0 + p.block_k, s_end); ++i) {
        if (k_pos[i] < 0) {
          block_has_empty = true;
        } else {
          block_lo = std::min(block_lo, k_pos[i]);
          block_hi = std::max(block_hi, k_pos[i]);
        }
      }
      for_row_groups(RV, [&](auto rt, int64_t j0) {
        constexpr int RT = decltype(rt)::value;
        // The group's keys in this block: over a contiguous cache up to its last row's position. Only tiles with a
        // key some row does not see (past a row's position, empty, or padding) are masked.
        const int64_t group_min_pos = w.pos[j0 * kLanes], group_max_pos = w.pos[(j0 + RT) * kLanes - 1];
        const int64_t n = k_pos ? std::min<int64_t>(p.block_k, s_end - s0)
                                : std::min<int64_t>({p.block_k, s_end - s0, group_max_pos + 1 - s0});
        const int64_t n8 = (n + 7) / 8 * 8;
        if (n <= 0 || (k_pos && block_lo > group_max_pos)) return;  // the whole block is after these rows
        const bool masked =
            n8 > n || (k_pos ? block_has_empty || block_hi > group_min_pos : s0 + n - 1 > group_min_pos);
        // Scores; keys past n in the last tile of 8 re-read key n - 1 and are masked (position kNever).
        for (int64_t st = 0; st < n8; st += 8) {
          const float* kr[8];
          int32_t kp[8];
          for (int i = 0; i < 8; ++i) {
            const int64_t slot = s0 + std::min<int64_t>(st + i, n - 1);
            kr[i] = k_base + slot * kv_stride;
            const int32_t position = k_pos ? (k_pos[slot] < 0 ? kNever : k_pos[slot]) : static_cast<int32_t>(slot);
            kp[i] = st + i < n ? position : kNever;
          }
          qk_tile<RT>(w.qt + j0 * kLanes, R, kr, E, w.s + st * R + j0 * kLanes, w.bmax + j0 * kLanes, masked, kp,
                      w.pos + j0 * kLanes);
        }
        tile(rt, j0, s0, n, n8);
      });
    }
  };

  for_each_tile([&](auto rt, int64_t j0, int64_t s0, int64_t n, int64_t n8) {
    constexpr int RT = decltype(rt)::value;
    // Online softmax, all vertical over keys.
    for (int64_t j = j0; j < j0 + RT; ++j) {
      float* sj = w.s + j * kLanes;
      const vf m_old = load(w.m + j * kLanes), m_new = vmax(m_old, load(w.bmax + j * kLanes));
      const vf m_use = m_new == neg_inf ? vf{} : m_new;       // a row with nothing visible yet stays at zero
      const vf alpha = exp2_neg(m_old - m_use);
      vf sum{};
      for (int64_t i = 0; i < n8; ++i) {
        const vf e = exp2_neg(load(sj + i * R) - m_use);
        store(sj + i * R, e);
        sum += e;
      }
      store(w.m + j * kLanes, m_new);
      store(w.alpha + j * kLanes, alpha);
      store(w.l + j * kLanes, load(w.l + j * kLanes) * alpha + sum);
      store(w.bmax + j * kLanes, neg_inf);
    }
    // O^T = alpha * O^T + V^T P^T over the n real keys.
    for (int64_t e0 = 0; e0 < E; e0 += 8)
      pv_tile<RT>(w.ot + e0 * R + j0 * kLanes, R, w.s + j0 * kLanes, v_base + s0 * kv_stride + e0, kv_stride, n,
                  w.alpha + j0 * kLanes);
  });
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = w.l[r] > 0.0f ? 1.0f / w.l[r] : 0.0f;
    float* dst = out_row(r);
    for (int64_t e = 0; e < E; ++e) dst[e] = w.ot[e * R + r] * inv;
  }
  if (!received) return;

  // Each row's probabilities are now 2^(s - m) / l: a second pass over the keys sums them down the rows, each row
  // weighted by its query's weight / l (0 for padding rows and rows that see no key, whose m stays -inf).
  for (int64_t r = 0; r < R; ++r) {
    const bool real = r < rows && w.l[r] > 0.0f;
    w.weight[r] = real ? p.weights[b * p.T + t0 + r / G] / w.l[r] : 0.0f;
    if (!real) w.m[r] = 0.0f;
  }
  for_each_tile([&](auto rt, int64_t j0, int64_t s0, int64_t n, int64_t n8) {
    constexpr int RT = decltype(rt)::value;
    for (int64_t i = 0; i < n; ++i) {
      vf acc{};
#pragma GCC unroll 3
      for (int64_t j = j0; j < j0 + RT; ++j)
        acc += exp2_neg(load(w.s + i * R + j * kLanes) - load(w.m + j * kLanes)) * load(w.weight + j * kLanes);
      received[s0 + i] += hsum(acc);
    }
  });
}

// The items of one call, claimed one at a time by the caller and the pool's threads, costliest first.
struct Job {
  Problem p;
  std::vector<int32_t> kv_len;                                // clamped to [0, S]
  std::vector<int64_t> items;                                 // (b * Kh + kh) * nqb + qb
  int64_t nqb;
  std::atomic<int64_t> next{0}, done{0};

  void work() {
    thread_local Scratch w;
    w.ensure(p);
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      const int64_t it = items[i], qb = it % nqb, bkh = it / nqb;
      run_item(p, w, bkh / p.Kh, bkh % p.Kh, qb);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
               ffi::Buffer<ffi::S32> q_offset, ffi::Buffer<ffi::S32> kv_len, const ffi::Buffer<ffi::S32>* k_positions,
               const ffi::Buffer<ffi::F32>* weights, ffi::ResultBuffer<ffi::F32> out,
               ffi::ResultBuffer<ffi::F32>* received, float scale, int64_t block_q, int64_t block_k,
               int64_t num_threads) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  const auto vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return ffi::Error::InvalidArgument("cpu_attention: q [B,T,H,E], k and v [B,S,Kh,E] expected");
  const int64_t B = qd[0], T = qd[1], H = qd[2], E = qd[3], S = kd[1], Kh = kd[2];
  if (kd[0] != B || kd[3] != E || Kh == 0 || H % Kh != 0 || E % 8 != 0)
    return ffi::Error::InvalidArgument("cpu_attention: shapes disagree (H % Kh == 0 and E % 8 == 0 needed)");
  if (q_offset.element_count() != static_cast<size_t>(B) || kv_len.element_count() != static_cast<size_t>(B))
    return ffi::Error::InvalidArgument("cpu_attention: q_offset and kv_len must be [B]");
  if (block_q < 1 || block_k < 1) return ffi::Error::InvalidArgument("cpu_attention: bad block sizes");
  if (k_positions && k_positions->element_count() != static_cast<size_t>(B * S))
    return ffi::Error::InvalidArgument("cpu_attention: k_positions must be [B, S]");
  const int64_t nqb = T > 0 ? (T + std::min(block_q, T) - 1) / std::min(block_q, T) : 0;
  if (received && (weights->element_count() != static_cast<size_t>(B * T) ||
                   (*received)->element_count() != static_cast<size_t>(B * Kh * nqb * S)))
    return ffi::Error::InvalidArgument("cpu_attention: weights must be [B, T] and received [B, Kh, nqb, S]");
  if (B * T * H == 0) return ffi::Error::Success();

  auto job = std::make_shared<Job>();
  Problem& p = job->p;
  p = Problem{q.typed_data(), k.typed_data(), v.typed_data(), q_offset.typed_data(), kv_len.typed_data(), nullptr,
              out->typed_data(), B, T, H, S, Kh, E, H / Kh, static_cast<int>(std::min(block_q, T)),
              static_cast<int>(block_k), static_cast<float>(1.4426950408889634 * scale)};
  // kv_len beyond S would read past the cache: clamp a copy.
  job->kv_len.assign(kv_len.typed_data(), kv_len.typed_data() + B);
  for (auto& x : job->kv_len) x = static_cast<int32_t>(std::clamp<int64_t>(x, 0, S));
  p.kv_len = job->kv_len.data();
  p.k_pos = k_positions ? k_positions->typed_data() : nullptr;
  if (received) {
    p.weights = weights->typed_data();
    p.received = (*received)->typed_data();
  }
  p.nqb = nqb;

  job->nqb = nqb;
  const int64_t n = B * Kh * job->nqb;
  job->items.resize(n);
  std::iota(job->items.begin(), job->items.end(), 0);
  auto cost = [&](int64_t it) {                               // keys read by an item
    const int64_t qb = it % job->nqb, b = it / job->nqb / Kh;
    const int64_t last = std::min<int64_t>(T, (qb + 1) * p.block_q) - 1;
    return p.k_pos ? p.kv_len[b] : std::min<int64_t>(p.kv_len[b], p.q_offset[b] + last + 1);
  };
  std::stable_sort(job->items.begin(), job->items.end(), [&](int64_t a, int64_t c) { return cost(a) > cost(c); });

  const int64_t threads = num_threads > 0 ? num_threads : std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min(threads - 1, n - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                     ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_offset, ffi::Buffer<ffi::S32> kv_len,
                     ffi::ResultBuffer<ffi::F32> out, float scale, int64_t block_q, int64_t block_k,
                     int64_t num_threads) {
  return Run(pool, q, k, v, q_offset, kv_len, nullptr, nullptr, out, nullptr, scale, block_q, block_k, num_threads);
}

ffi::Error AttentionAt(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_offset, ffi::Buffer<ffi::S32> kv_len,
                       ffi::Buffer<ffi::S32> k_positions, ffi::ResultBuffer<ffi::F32> out, float scale,
                       int64_t block_q, int64_t block_k, int64_t num_threads) {
  return Run(pool, q, k, v, q_offset, kv_len, &k_positions, nullptr, out, nullptr, scale, block_q, block_k,
             num_threads);
}

ffi::Error AttentionReceivedAt(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_offset, ffi::Buffer<ffi::S32> kv_len,
                               ffi::Buffer<ffi::S32> k_positions, ffi::Buffer<ffi::F32> weights,
                               ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> received, float scale,
                               int64_t block_q, int64_t block_k, int64_t num_threads) {
  return Run(pool, q, k, v, q_offset, kv_len, &k_positions, &weights, out, &received, scale, block_q, block_k,
             num_threads);
}

// The operands every entry point shares; then each adds its own (key positions, weights) and outputs.
auto BindInputs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()   // q [B, T, H, E]
      .Arg<ffi::Buffer<ffi::F32>>()   // k [B, S, Kh, E]
      .Arg<ffi::Buffer<ffi::F32>>()   // v [B, S, Kh, E]
      .Arg<ffi::Buffer<ffi::S32>>()   // q_offset [B]
      .Arg<ffi::Buffer<ffi::S32>>();  // kv_len [B]
}

template <typename Binding>
auto BindAttributes(Binding binding) {
  return std::move(binding).template Attr<float>("scale")
      .template Attr<int64_t>("block_q")
      .template Attr<int64_t>("block_k")
      .template Attr<int64_t>("num_threads");  // 0: the XLA intra-op pool's size
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuFlashAttention, Attention,
                              BindAttributes(BindInputs().Ret<ffi::Buffer<ffi::F32>>()));  // out [B, T, H, E]

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuFlashAttentionAt, AttentionAt,
                              BindAttributes(BindInputs()
                                                 .Arg<ffi::Buffer<ffi::S32>>()      // k_positions [B, S]
                                                 .Ret<ffi::Buffer<ffi::F32>>()));   // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuFlashAttentionReceivedAt, AttentionReceivedAt,
                              BindAttributes(BindInputs()
                                                 .Arg<ffi::Buffer<ffi::S32>>()      // k_positions [B, S]
                                                 .Arg<ffi::Buffer<ffi::F32>>()      // weights [B, T]
                                                 .Ret<ffi::Buffer<ffi::F32>>()      // out
                                                 .Ret<ffi::Buffer<ffi::F32>>()));   // received [B, Kh, nqb, S]
