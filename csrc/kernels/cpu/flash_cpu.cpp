// flash_attn_ext CPU kernels: FlashAttention-2 (Dao 2023) Alg. 1 (forward) and Alg. 2
// (backward) on tiles of kBlockM query rows x kBlockN key rows. See flash_cpu.h.
//
// Every tile is copied into dense scratch in the accumulation type `Acc`: float for 16-bit inputs,
// double for float32 and float64 ones (a float32 running sum over N keys, O and l, or over a GQA
// group's N query rows, dK and dV, errs by ~N ulps: at seqlen_q 8192 with MQA 8:1, dK was 20x
// further from the float64 reference than torch's blocked float32 math). K and V are also kept
// transposed (headdim x kBlockN, zero padded), so S = Q K^T and dP = dO V^T are axpy loops over a
// contiguous row of kBlockN: the inner loops of every product run over contiguous memory with a
// fixed trip count and vectorize without -ffast-math.
#include "kernels/cpu/flash_cpu.h"
#include "primitives/philox.cuh"

#include <stdexcept>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace flash {
namespace cpu {
namespace {

constexpr int kBlockM = 64;  // query rows per tile
constexpr int kBlockN = 64;  // key/value rows per tile

// The keys query row i sees, [begin, end) (empty: begin >= end): with off = seqlen_k - seqlen_q
// (bottom-right alignment), j <= i + off under causal (or j <= i + off + window_right), and
// j >= i + off - window_left for a sliding window (flash.h; the CUDA kernels' contract,
// kernels/common/mask.cuh). Clamped to [0, seqlen_k].
struct KeyRange {
  int begin, end;
};
inline KeyRange visible_keys(const Flash_fwd_params& p, int i) {
  const int64_t diag = int64_t(i) + p.seqlen_k - p.seqlen_q;
  int64_t end = p.seqlen_k, begin = 0;
  if (p.is_causal) end = std::min<int64_t>(end, diag + 1);
  else if (p.window_right >= 0) end = std::min<int64_t>(end, diag + p.window_right + 1);
  if (p.window_left >= 0) begin = std::max<int64_t>(0, diag - p.window_left);
  return {int(begin), int(std::max<int64_t>(end, 0))};
}

// The visible keys of row i inside the key tile starting at n0 with rows_n rows, as tile columns
// [begin, end): the visible keys of a row are an interval, so the mask is two column bounds.
inline KeyRange visible_in_tile(const Flash_fwd_params& p, int i, int n0, int rows_n) {
  const KeyRange r = visible_keys(p, i);
  return {std::min(std::max(r.begin - n0, 0), rows_n), std::min(std::max(r.end - n0, 0), rows_n)};
}

// rows x d tile (row-major, leading dim d) <- rows of one head starting at `src`.
template <typename T, typename Acc>
void load_rows(const T* src, int64_t row_stride, int rows, int d, Acc* dst) {
  for (int r = 0; r < rows; ++r) {
    const T* s = src + r * row_stride;
    Acc* o = dst + int64_t(r) * d;
    for (int c = 0; c < d; ++c) o[c] = static_cast<Acc>(s[c]);
  }
}

// d x kBlockN transposed tile (columns >= rows are zero) <- rows of one head.
template <typename T, typename Acc>
void load_rows_transposed(const T* src, int64_t row_stride, int rows, int d, Acc* dst) {
  if (rows < kBlockN) std::fill(dst, dst + int64_t(d) * kBlockN, Acc(0));
  for (int r = 0; r < rows; ++r) {
    const T* s = src + r * row_stride;
    for (int c = 0; c < d; ++c) dst[int64_t(c) * kBlockN + r] = static_cast<Acc>(s[c]);
  }
}

// C (rows_m x kBlockN) = A (rows_m x d) * Bt (d x kBlockN): the S = Q K^T / dP = dO V^T product.
template <typename Acc>
void matmul_abt(const Acc* A, int rows_m, const Acc* Bt, int d, Acc* C) {
  for (int i = 0; i < rows_m; ++i) {
    Acc* c_row = C + int64_t(i) * kBlockN;
    std::fill(c_row, c_row + kBlockN, Acc(0));
    const Acc* a_row = A + int64_t(i) * d;
    for (int kk = 0; kk < d; ++kk) {
      const Acc a = a_row[kk];
      const Acc* b_row = Bt + int64_t(kk) * kBlockN;
      for (int j = 0; j < kBlockN; ++j) c_row[j] += a * b_row[j];
    }
  }
}

// Logit soft-capping (flash.h: softcap > 0): the logit of score S is softcap * tanh(S *
// softmax_scale / softcap), in log2 units t * softcap * log2(e) with t = tanh(S * prescale), the
// kernels' two rounding points (t, then the product), here in the accumulation type. Constants from
// p.softcap (float32) and softmax_scale (double), as the non-capped path's scale_log2.
template <typename Acc>
struct Softcap {
  bool on;
  Acc prescale;  // softmax_scale / softcap
  Acc cap_log2;  // softcap * log2(e): the exp2 scale of t
  explicit Softcap(const Flash_fwd_params& p)
      : on(p.softcap > 0.f),
        prescale(on ? static_cast<Acc>(p.scale_softmax / double(p.softcap)) : Acc(0)),
        cap_log2(on ? static_cast<Acc>(double(p.softcap) * 1.4426950408889634074) : Acc(0)) {}
  Acc tanh_of(Acc s) const { return std::tanh(s * prescale); }  // t
};

// Attention dropout (flash.h: dropout_p > 0): the CUDA kernels' mask (primitives/philox.cuh), one
// Philox call per element here; the kept probabilities scaled by rp = 1 / (1 - threshold / 2^16) in
// the accumulation type.
template <typename Acc>
struct Dropout {
  bool on;
  DropoutRng rng;
  Acc rp;
  int batch0, nheads;
  explicit Dropout(const Flash_fwd_params& p)
      : on(p.dropout_p > 0.f),
        rng(on ? DropoutRng(p.dropout_rng_state, p.dropout_threshold) : DropoutRng()),
        rp(on ? Acc(1) / (Acc(1) - static_cast<Acc>(p.dropout_threshold) / Acc(65536)) : Acc(1)),
        batch0(p.dropout_batch0),
        nheads(p.h) {}
  // Z_qk of batch b, head h: whether the element is kept (always without dropout).
  bool keep(int b, int h, int q, int k) const {
    return !on || rng.keep(DropoutRng::head_word(int64_t(batch0) + b, nheads, h), q, k);
  }
  // Z_qk rp x for the element's `kept` (keep()): the backward's P (for dV) and dP (for dS); a dropped
  // element is 0 whatever x is (a NaN included, as the kernels' selects and the reference's where);
  // exactly x without dropout.
  Acc scaled(Acc x, bool kept) const { return !on ? x : kept ? x * rp : Acc(0); }
};

// ALiBi (flash.h: alibi_slopes_ptr): the score S of query i, key j (the sequence's own positions)
// gains slope * unit * |i + seqlen_k - seqlen_q - j| before the scale, unit = -1 / softmax_scale, so
// the logit gains -slope * |...| (as the kernels, which hold unit in float32; here in the
// accumulation type). Never with soft-capping or dropout (the API refuses those).
template <typename Acc>
struct Alibi {
  bool on;
  const float* slopes;
  int64_t batch_stride;
  Acc unit;
  int off;  // seqlen_k - seqlen_q
  explicit Alibi(const Flash_fwd_params& p)
      : on(p.alibi_slopes_ptr != nullptr),
        slopes(p.alibi_slopes_ptr),
        batch_stride(p.alibi_slopes_batch_stride),
        unit(on ? static_cast<Acc>(-1.0 / p.scale_softmax) : Acc(0)),
        off(p.seqlen_k - p.seqlen_q) {}
  // The score-unit slope of batch b, head h (0 without ALiBi: S unchanged); an overflow to +-inf
  // clamped to the type's largest finite value, as the kernels (mask.cuh: alibi_slope).
  Acc slope(int64_t b, int h) const {
    if (!on) return Acc(0);
    const Acc s = static_cast<Acc>(slopes[b * batch_stride + h]) * unit;
    return std::isinf(s) ? std::copysign(std::numeric_limits<Acc>::max(), s) : s;
  }
  // S_ij + the bias (s when off).
  Acc biased(Acc s, Acc slope_u, int i, int j) const {
    return on ? s + slope_u * static_cast<Acc>(std::abs(i + off - j)) : s;
  }
};

// y[0:d] += alpha * x[0:d]
template <typename Acc>
inline void axpy(Acc alpha, const Acc* x, Acc* y, int d) {
  for (int c = 0; c < d; ++c) y[c] += alpha * x[c];
}

// The unit of parallel work of the forward and the dQ pass: one query tile of one (batch, head).
// task = (b * nheads + h) * num_m_blocks + m_block.
struct QTile {
  int b, h, h_k;  // batch, query head, its kv head (GQA)
  int m0, rows_m;  // first row and number of valid rows of the tile
};

inline QTile q_tile_of(const Flash_fwd_params& p, int64_t task, int num_m_blocks) {
  const int mb = int(task % num_m_blocks);
  const int h = int((task / num_m_blocks) % p.h);
  const int m0 = mb * kBlockM;
  return {int(task / (int64_t(num_m_blocks) * p.h)), h, h / p.h_h_k_ratio, m0,
          std::min(kBlockM, p.seqlen_q - m0)};
}

// ------------------------------------------------------------------------------------------
// Forward: one task = one (batch, head, query tile). FA2 Alg. 1, in log2 units as the CUDA
// kernels (primitives/softmax.cuh): s' = S * softmax_scale * log2(e) rounded once (soft-capped:
// s' = tanh(S * prescale) * softcap * log2(e), Softcap), m = max s', P = exp2(s' - m), so P <= 1
// at any magnitude; the LSE leaves as (m, log2 l) too (flash.h).
// kLseOnly: compute only the LSE's two parts (no V, no output) into max_acc / log2sum_acc
// [(b * h + head) * seqlen_q + i] in the accumulation type. The float64 backward uses it: the
// op's float32 statistics are too coarse to recompute float64 probabilities from.
template <typename T, typename Acc, bool kLseOnly>
void fwd_impl(const Flash_fwd_params& p, Acc* max_acc, Acc* log2sum_acc) {
  const int d = p.d;
  const int num_m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t num_tasks = int64_t(p.b) * p.h * num_m_blocks;
  const Acc scale_log2 = static_cast<Acc>(p.scale_softmax * 1.4426950408889634074);
  const Softcap<Acc> softcap(p);
  const Dropout<Acc> dropout(p);
  const Alibi<Acc> alibi(p);
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();

  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<Acc> q_tile(int64_t(kBlockM) * d), acc(int64_t(kBlockM) * d);
    std::vector<Acc> kt_tile(int64_t(d) * kBlockN), v_tile(int64_t(kBlockN) * d);
    std::vector<Acc> s_tile(int64_t(kBlockM) * kBlockN), m_row(kBlockM), l_row(kBlockM);

    for (int64_t task = begin; task < end; ++task) {
      const auto [b, h, h_k, m0, rows_m] = q_tile_of(p, task, num_m_blocks);
      const Acc slope_u = alibi.slope(b, h);

      const T* q = static_cast<const T*>(p.q.ptr) + b * p.q.batch_stride + h * p.q.head_stride;
      const T* k = static_cast<const T*>(p.k.ptr) + b * p.k.batch_stride + h_k * p.k.head_stride;
      const T* v = static_cast<const T*>(p.v.ptr) + b * p.v.batch_stride + h_k * p.v.head_stride;

      // Alg. 1 lines 5-6: load Q_i; O_i = 0, l_i = 0, m_i = -inf.
      load_rows(q + m0 * p.q.row_stride, p.q.row_stride, rows_m, d, q_tile.data());
      std::fill(acc.begin(), acc.end(), Acc(0));
      std::fill(l_row.begin(), l_row.end(), Acc(0));
      std::fill(m_row.begin(), m_row.end(), neg_inf);

      // Key tiles some row sees: the first row starts first, the last row ends last (causal and a
      // window skip the others).
      const int n_begin = visible_keys(p, m0).begin / kBlockN * kBlockN;
      const int n_end = visible_keys(p, m0 + rows_m - 1).end;
      for (int n0 = n_begin; n0 < n_end; n0 += kBlockN) {
        const int rows_n = std::min(kBlockN, p.seqlen_k - n0);
        // Alg. 1 line 8: load K_j, V_j.
        load_rows_transposed(k + n0 * p.k.row_stride, p.k.row_stride, rows_n, d, kt_tile.data());
        if (!kLseOnly) load_rows(v + n0 * p.v.row_stride, p.v.row_stride, rows_n, d, v_tile.data());
        // Alg. 1 line 9: S_ij = Q_i K_j^T (softmax_scale applied per row below).
        matmul_abt(q_tile.data(), rows_m, kt_tile.data(), d, s_tile.data());

        for (int i = 0; i < rows_m; ++i) {
          const auto [c0, c1] = visible_in_tile(p, m0 + i, n0, rows_n);
          if (c1 <= c0) continue;  // masked entries contribute exp(-inf) = 0
          Acc* s = s_tile.data() + int64_t(i) * kBlockN;
          // Alg. 1 line 10: m_new = max(m_old, rowmax(S_ij)) (scaled, log2 units; capped first, or
          // ALiBi's bias added first).
          Acc m_new = m_row[i];
          if (softcap.on) {
            for (int j = c0; j < c1; ++j) {
              s[j] = softcap.tanh_of(s[j]) * softcap.cap_log2;
              m_new = std::max(m_new, s[j]);
            }
          } else {
            for (int j = c0; j < c1; ++j) {
              s[j] = alibi.biased(s[j], slope_u, m0 + i, n0 + j) * scale_log2;
              m_new = std::max(m_new, s[j]);
            }
          }
          // Every score so far -inf (ALiBi's bias past the type's range): P = 0, as the kernels'
          // -inf max gives (exp2(-inf - -inf) would be NaN); a row left so is one without keys. (A
          // NaN score leaves std::max's m at -inf too: it goes on, to reach the output.)
          if (m_new == neg_inf && std::all_of(s + c0, s + c1, [&](Acc x) { return x == neg_inf; })) continue;
          // Alg. 1 line 10: P~ = exp2(S - m_new), l_new = exp2(m_old - m_new) l_old + rowsum(P~).
          const Acc alpha = std::exp2(m_row[i] - m_new);  // 0 on the first visible tile
          Acc row_sum = 0;
          for (int j = c0; j < c1; ++j) {
            s[j] = std::exp2(s[j] - m_new);
            row_sum += s[j];
          }
          l_row[i] = alpha * l_row[i] + row_sum;
          m_row[i] = m_new;
          if (kLseOnly) continue;
          // Alg. 1 line 11: O_i = diag(exp(m_old - m_new)) O_i + P~ V_j (dropout: (Z o P~) V_j, l
          // from P~ itself; rp at the end).
          Acc* o = acc.data() + int64_t(i) * d;
          for (int c = 0; c < d; ++c) o[c] *= alpha;
          for (int j = c0; j < c1; ++j) {
            if (dropout.keep(b, h, m0 + i, n0 + j)) axpy(s[j], v_tile.data() + int64_t(j) * d, o, d);
          }
        }
      }

      // The LSE's two parts (m, log2 l), (+inf, 0) for a row without a visible key; the head's
      // sink (flash.h: sinks_ptr) adds gain = log2(1 + 2^t) to log2 l, t = sink log2(e) - (m +
      // log2 l), and scales O by 2^-gain (the CUDA kernels' sink_share, primitives/softmax.cuh).
      const int64_t stat0 = (int64_t(b) * p.h + h) * p.seqlen_q + m0;
      const Acc inf = std::numeric_limits<Acc>::infinity();
      const float sink = p.sinks_ptr != nullptr ? p.sinks_ptr[h] : -std::numeric_limits<float>::infinity();
      auto stat_max = [&](int i) { return l_row[i] == Acc(0) ? inf : m_row[i]; };
      auto keys_log2sum = [&](int i) { return l_row[i] == Acc(0) ? Acc(0) : std::log2(l_row[i]); };
      auto sink_gain = [&](int i) -> Acc {
        if (l_row[i] == Acc(0) || sink == -std::numeric_limits<float>::infinity()) return Acc(0);
        const Acc t = Acc(sink) * Acc(1.4426950408889634074) - (m_row[i] + keys_log2sum(i));
        return t > Acc(0) ? t + std::log2(Acc(1) + std::exp2(-t)) : std::log1p(std::exp2(t)) * Acc(1.4426950408889634074);
      };
      if (kLseOnly) {
        for (int i = 0; i < rows_m; ++i) {
          max_acc[stat0 + i] = stat_max(i);
          log2sum_acc[stat0 + i] = keys_log2sum(i) + sink_gain(i);
        }
        continue;
      }
      // Alg. 1 lines 13-16: O_i = diag(l_i)^-1 O_i, L_i = (m_i + log2 l_i) ln 2; write both. A row
      // without keys: O 0, L = the sink (+inf without one).
      T* out = static_cast<T*>(p.o.ptr) + b * p.o.batch_stride + h * p.o.head_stride;
      for (int i = 0; i < rows_m; ++i) {
        T* o_row = out + (m0 + i) * p.o.row_stride;
        const Acc* a = acc.data() + int64_t(i) * d;
        const Acc gain = sink_gain(i);
        // out = 0 for a row without keys
        const Acc inv_l =
            l_row[i] == Acc(0) ? Acc(0) : (gain == Acc(0) ? Acc(1) : std::exp2(-gain)) / l_row[i] * dropout.rp;
        for (int c = 0; c < d; ++c) o_row[c] = static_cast<T>(a[c] * inv_l);
        const Acc m = stat_max(i), l2 = keys_log2sum(i) + gain;
        const bool empty_with_sink = l_row[i] == Acc(0) && sink != -std::numeric_limits<float>::infinity();
        p.softmax_lse_ptr[stat0 + i] =
            empty_with_sink ? sink : static_cast<float>((m + l2) * Acc(0.69314718055994530942));
        if (p.row_max_ptr != nullptr) {
          p.row_max_ptr[stat0 + i] = static_cast<float>(m);
          p.row_log2sum_ptr[stat0 + i] = static_cast<float>(l2);
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------------------
// Backward. P is recomputed from the LSE as the CUDA kernels' exact path does
// (primitives/softmax.cuh: recompute_p): P_ij = exp2(min(s'_ij - hi_i, 0) - lo_i) with
// s' = S * softmax_scale * log2(e) rounded as the forward rounded it and LSE_i log2(e) = hi_i + lo_i
// = m_i + log2 l_i from the forward's softmax_stats (else hi = LSE log2(e), lo = 0).
// Soft-capped (Softcap): s' = t * softcap * log2(e), t = tanh(S * prescale), as the forward, and
// dS = P (dP - D) (1 - t^2) (dt/d(S prescale)), before the final softmax_scale of dQ and dK.
template <typename T, typename Acc>
void bwd_impl(const Flash_bwd_params& p) {
  const int d = p.d;
  const int num_m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
  const int num_n_blocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
  const Acc scale = static_cast<Acc>(p.scale_softmax);
  const Acc scale_log2 = static_cast<Acc>(p.scale_softmax * 1.4426950408889634074);
  const Softcap<Acc> softcap(p);
  const Dropout<Acc> dropout(p);
  const Alibi<Acc> alibi(p);
  const int64_t rows_total = int64_t(p.b) * p.h * p.seqlen_q;

  // Alg. 2 line 5: D_i = rowsum(dO_i * O_i), one value per (batch, head, query row).
  std::vector<Acc> dsum(rows_total);
  at::parallel_for(0, int64_t(p.b) * p.h, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int b = int(bh / p.h), h = int(bh % p.h);
      const T* dout = static_cast<const T*>(p.dout.ptr) + b * p.dout.batch_stride + h * p.dout.head_stride;
      const T* out = static_cast<const T*>(p.o.ptr) + b * p.o.batch_stride + h * p.o.head_stride;
      for (int i = 0; i < p.seqlen_q; ++i) {
        const T* dr = dout + i * p.dout.row_stride;
        const T* orow = out + i * p.o.row_stride;
        Acc sum = 0;
        for (int c = 0; c < d; ++c) sum += static_cast<Acc>(dr[c]) * static_cast<Acc>(orow[c]);
        dsum[bh * p.seqlen_q + i] = sum;
      }
    }
  });

  // (hi_i, lo_i) for recomputing P. With the forward's softmax_stats and double accumulation
  // (float32 and float64 inputs): recomputed in double (one more pass over K), since the float32
  // statistics are coarser than the double scores they must match; a caller's own softmax_lse alone
  // (e.g. merged over chunks of K/V) is used as given.
  std::vector<Acc> hi_acc, lo_acc;
  if (std::is_same<Acc, double>::value && p.row_max_ptr != nullptr) {
    hi_acc.resize(rows_total);
    lo_acc.resize(rows_total);
    fwd_impl<T, Acc, /*kLseOnly=*/true>(p, hi_acc.data(), lo_acc.data());
    // The recomputed statistics must be the given ones up to their float32 rounding: else they
    // belong to another forward (other q / k, or its sinks not passed here), and P from the
    // recompute would be another attention's, silently.
    // Part by part, as the forward stored them (float32 casts of the same doubles): the max must
    // match, and the log2 sum, which a dropped sink changes, to 2 float32 ulps (not to the max's
    // scale); infinities (no keys, or statistics past float32) must match exactly.
    auto same = [](float a, float b) {
      if (std::isinf(a) || std::isinf(b)) return a == b;
      return std::abs(double(a) - double(b)) <=
             2.0 * std::numeric_limits<float>::epsilon() * std::max(std::abs(double(a)), std::abs(double(b)));
    };
    for (int64_t r = 0; r < rows_total; ++r) {
      const float hi = static_cast<float>(hi_acc[r]), lo = static_cast<float>(lo_acc[r]);
      const float given_hi = p.row_max_ptr[r], given_lo = p.row_log2sum_ptr[r];
      if (std::isnan(hi) || std::isnan(lo) || std::isnan(given_hi) || std::isnan(given_lo)) continue;  // NaN inputs
      if (!same(hi, given_hi) || !same(lo, given_lo)) {
        throw std::runtime_error(
            "flash_attn_ext: softmax_stats do not match this backward's arguments (the float32 / float64 CPU "
            "backward recomputes them): pass the q, k, softmax_scale, causal, window_size, sinks, softcap and "
            "alibi_slopes of the forward that returned them (the backward must see the forward's attention; "
            "softmax_stats=None skips this check, it does not make other arguments right)");
      }
    }
  }
  auto row_hi_lo = [&](int b, int h, int i) -> std::pair<Acc, Acc> {
    const int64_t idx = (int64_t(b) * p.h + h) * p.seqlen_q + i;
    if (!hi_acc.empty()) return {hi_acc[idx], lo_acc[idx]};
    if (p.row_max_ptr != nullptr) return {Acc(p.row_max_ptr[idx]), Acc(p.row_log2sum_ptr[idx])};
    return {Acc(p.softmax_lse_ptr[idx]) * Acc(1.4426950408889634074), Acc(0)};
  };
  // Alg. 2 line 12 (see above). The recomputed scores are the forward's bit for bit (the same
  // tiles, the same summation order), so no tie tolerance is needed here. A row without keys has
  // hi = +inf: P = 0.
  // s2: the scaled score in log2 units (s' above).
  auto prob = [&](Acc s2, Acc hi, Acc lo) {
    const Acc x = s2 - hi;
    return std::exp2((x > Acc(0) ? Acc(0) : x) - lo);  // not std::min: NaN stays NaN
  };
  auto row_dsum = [&](int b, int h, int i) { return dsum[(int64_t(b) * p.h + h) * p.seqlen_q + i]; };
  // Alg. 2 lines 11-12 and 14-15 for one (Q tile i, K tile j) pair of batch b, head h: S = Q_i K_j^T,
  // dP = dO_i V_j^T (Q_i, dO_i: rows_m x d; K_j^T, V_j^T: d x kBlockN), then
  // visit(row, key, P, dS = P (dP - D)) for every visible (row of the Q tile, key of the K tile).
  // Dropout: visit(row, key, Z P / (1 - p), dS = P (Z dP / (1 - p) - D)) (flash.h: dropout_p).
  auto for_each_visible_ds = [&](int b, int h, int m0, int rows_m, int n0, int rows_n, const Acc* q_tile,
                                 const Acc* do_tile, const Acc* kt_tile, const Acc* vt_tile, Acc* s_tile, Acc* dp_tile,
                                 auto&& visit) {
    matmul_abt(q_tile, rows_m, kt_tile, d, s_tile);
    matmul_abt(do_tile, rows_m, vt_tile, d, dp_tile);
    for (int i = 0; i < rows_m; ++i) {
      const auto [c0, c1] = visible_in_tile(p, m0 + i, n0, rows_n);
      if (c1 <= c0) continue;  // P = 0: no contribution (also rows with LSE = +inf)
      const auto [hi, lo] = row_hi_lo(b, h, m0 + i);
      const Acc dsum_i = row_dsum(b, h, m0 + i);
      const Acc* s = s_tile + int64_t(i) * kBlockN;
      const Acc* dp = dp_tile + int64_t(i) * kBlockN;
      if (softcap.on) {
        for (int j = c0; j < c1; ++j) {
          const Acc t = softcap.tanh_of(s[j]);
          const Acc pij = prob(t * softcap.cap_log2, hi, lo);
          const bool kept = dropout.keep(b, h, m0 + i, n0 + j);
          // dS_ij = P_ij (dP_ij - D_i) (1 - t_ij^2): the chain rule through the cap.
          visit(i, j, dropout.scaled(pij, kept), pij * (dropout.scaled(dp[j], kept) - dsum_i) * (Acc(1) - t * t));
        }
        continue;
      }
      const Acc slope_u = alibi.slope(b, h);
      for (int j = c0; j < c1; ++j) {
        // line 12: P_ij = exp(S_ij - L_i) (ALiBi: S_ij biased first; dS needs nothing more)
        const Acc pij = prob(alibi.biased(s[j], slope_u, m0 + i, n0 + j) * scale_log2, hi, lo);
        const bool kept = dropout.keep(b, h, m0 + i, n0 + j);
        // line 15: dS_ij = P_ij (dP_ij - D_i) (dropout: Z rp on P for dV and on dP)
        visit(i, j, dropout.scaled(pij, kept), pij * (dropout.scaled(dp[j], kept) - dsum_i));
      }
    }
  };

  // dK/dV pass: one task = one (batch, kv head, key tile); Alg. 2 lines 6-19 without dQ.
  // GQA/MQA: the task loops over every query head of its group, so each dK_j/dV_j is
  // written by exactly one task.
  at::parallel_for(0, int64_t(p.b) * p.h_k * num_n_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<Acc> kt_tile(int64_t(d) * kBlockN), vt_tile(int64_t(d) * kBlockN);
    std::vector<Acc> q_tile(int64_t(kBlockM) * d), do_tile(int64_t(kBlockM) * d);
    std::vector<Acc> s_tile(int64_t(kBlockM) * kBlockN), dp_tile(int64_t(kBlockM) * kBlockN);
    std::vector<Acc> dk_acc(int64_t(kBlockN) * d), dv_acc(int64_t(kBlockN) * d);

    for (int64_t task = begin; task < end; ++task) {
      const int nb = int(task % num_n_blocks);
      const int h_k = int((task / num_n_blocks) % p.h_k);
      const int b = int(task / (int64_t(num_n_blocks) * p.h_k));
      const int n0 = nb * kBlockN;
      const int rows_n = std::min(kBlockN, p.seqlen_k - n0);

      // Alg. 2 lines 7-8: load K_j, V_j; dK_j = 0, dV_j = 0.
      const T* k = static_cast<const T*>(p.k.ptr) + b * p.k.batch_stride + h_k * p.k.head_stride;
      const T* v = static_cast<const T*>(p.v.ptr) + b * p.v.batch_stride + h_k * p.v.head_stride;
      load_rows_transposed(k + n0 * p.k.row_stride, p.k.row_stride, rows_n, d, kt_tile.data());
      load_rows_transposed(v + n0 * p.v.row_stride, p.v.row_stride, rows_n, d, vt_tile.data());
      std::fill(dk_acc.begin(), dk_acc.end(), Acc(0));
      std::fill(dv_acc.begin(), dv_acc.end(), Acc(0));

      // The query rows that see a key of the tile: a right bound (causal, a window's right side)
      // skips the Q tiles before the first, a left bound (a window) the ones after the last.
      const int64_t off = int64_t(p.seqlen_k) - p.seqlen_q;
      const int64_t right = p.is_causal ? 0 : p.window_right;
      const int64_t first_row = right >= 0 ? std::max<int64_t>(0, n0 - off - right) : 0;
      const int64_t end_row = p.window_left >= 0 ? std::min<int64_t>(p.seqlen_q, n0 + rows_n - off + p.window_left)
                                                 : p.seqlen_q;
      const int m_begin = int(first_row / kBlockM) * kBlockM;
      const int m_end = int(std::max<int64_t>(end_row, 0));

      for (int h = h_k * p.h_h_k_ratio; h < (h_k + 1) * p.h_h_k_ratio; ++h) {
        const T* q = static_cast<const T*>(p.q.ptr) + b * p.q.batch_stride + h * p.q.head_stride;
        const T* dout = static_cast<const T*>(p.dout.ptr) + b * p.dout.batch_stride + h * p.dout.head_stride;
        for (int m0 = m_begin; m0 < m_end; m0 += kBlockM) {
          const int rows_m = std::min(kBlockM, p.seqlen_q - m0);
          // Alg. 2 line 10: load Q_i, dO_i (L_i, D_i read per row below).
          load_rows(q + m0 * p.q.row_stride, p.q.row_stride, rows_m, d, q_tile.data());
          load_rows(dout + m0 * p.dout.row_stride, p.dout.row_stride, rows_m, d, do_tile.data());
          for_each_visible_ds(b, h, m0, rows_m, n0, rows_n, q_tile.data(), do_tile.data(), kt_tile.data(),
                              vt_tile.data(), s_tile.data(), dp_tile.data(), [&](int i, int j, Acc pij, Acc ds) {
                                // Alg. 2 line 13: dV_j += P_ij^T dO_i; line 17: dK_j += dS_ij^T Q_i
                                // (softmax_scale applied once at the end).
                                axpy(pij, do_tile.data() + int64_t(i) * d, dv_acc.data() + int64_t(j) * d, d);
                                axpy(ds, q_tile.data() + int64_t(i) * d, dk_acc.data() + int64_t(j) * d, d);
                              });
        }
      }

      // Alg. 2 line 19: write dK_j, dV_j.
      T* dk = static_cast<T*>(p.dk.ptr) + b * p.dk.batch_stride + h_k * p.dk.head_stride;
      T* dv = static_cast<T*>(p.dv.ptr) + b * p.dv.batch_stride + h_k * p.dv.head_stride;
      for (int j = 0; j < rows_n; ++j) {
        T* dk_row = dk + (n0 + j) * p.dk.row_stride;
        T* dv_row = dv + (n0 + j) * p.dv.row_stride;
        const Acc* dk_a = dk_acc.data() + int64_t(j) * d;
        const Acc* dv_a = dv_acc.data() + int64_t(j) * d;
        for (int c = 0; c < d; ++c) {
          dk_row[c] = static_cast<T>(dk_a[c] * scale);
          dv_row[c] = static_cast<T>(dv_a[c]);
        }
      }
    }
  });

  // dQ pass: one task = one (batch, head, query tile), loop over key tiles; Alg. 2 line 16
  // done as its own loop (as in FA2's CUDA backward) so no two tasks write one dQ row.
  at::parallel_for(0, int64_t(p.b) * p.h * num_m_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<Acc> q_tile(int64_t(kBlockM) * d), do_tile(int64_t(kBlockM) * d);
    std::vector<Acc> dq_acc(int64_t(kBlockM) * d), k_tile(int64_t(kBlockN) * d);
    std::vector<Acc> kt_tile(int64_t(d) * kBlockN), vt_tile(int64_t(d) * kBlockN);
    std::vector<Acc> s_tile(int64_t(kBlockM) * kBlockN), dp_tile(int64_t(kBlockM) * kBlockN);

    for (int64_t task = begin; task < end; ++task) {
      const auto [b, h, h_k, m0, rows_m] = q_tile_of(p, task, num_m_blocks);

      const T* q = static_cast<const T*>(p.q.ptr) + b * p.q.batch_stride + h * p.q.head_stride;
      const T* dout = static_cast<const T*>(p.dout.ptr) + b * p.dout.batch_stride + h * p.dout.head_stride;
      const T* k = static_cast<const T*>(p.k.ptr) + b * p.k.batch_stride + h_k * p.k.head_stride;
      const T* v = static_cast<const T*>(p.v.ptr) + b * p.v.batch_stride + h_k * p.v.head_stride;
      load_rows(q + m0 * p.q.row_stride, p.q.row_stride, rows_m, d, q_tile.data());
      load_rows(dout + m0 * p.dout.row_stride, p.dout.row_stride, rows_m, d, do_tile.data());
      std::fill(dq_acc.begin(), dq_acc.end(), Acc(0));

      const int n_begin = visible_keys(p, m0).begin / kBlockN * kBlockN;
      const int n_end = visible_keys(p, m0 + rows_m - 1).end;
      for (int n0 = n_begin; n0 < n_end; n0 += kBlockN) {
        const int rows_n = std::min(kBlockN, p.seqlen_k - n0);
        load_rows(k + n0 * p.k.row_stride, p.k.row_stride, rows_n, d, k_tile.data());
        load_rows_transposed(k + n0 * p.k.row_stride, p.k.row_stride, rows_n, d, kt_tile.data());
        load_rows_transposed(v + n0 * p.v.row_stride, p.v.row_stride, rows_n, d, vt_tile.data());
        // Alg. 2 line 16: dQ_i += dS_ij K_j.
        for_each_visible_ds(b, h, m0, rows_m, n0, rows_n, q_tile.data(), do_tile.data(), kt_tile.data(),
                            vt_tile.data(), s_tile.data(), dp_tile.data(), [&](int i, int j, Acc, Acc ds) {
                              axpy(ds, k_tile.data() + int64_t(j) * d, dq_acc.data() + int64_t(i) * d, d);
                            });
      }

      T* dq = static_cast<T*>(p.dq.ptr) + b * p.dq.batch_stride + h * p.dq.head_stride;
      for (int i = 0; i < rows_m; ++i) {  // rows that see no key keep dQ = 0
        T* dq_row = dq + (m0 + i) * p.dq.row_stride;
        const Acc* a = dq_acc.data() + int64_t(i) * d;
        for (int c = 0; c < d; ++c) dq_row[c] = static_cast<T>(a[c] * scale);
      }
    }
  });
}

}  // namespace

void run_mha_fwd_cpu(const Flash_fwd_params& params, Dtype dtype) {
  switch (dtype) {
    case Dtype::kFloat32: return fwd_impl<float, double, false>(params, nullptr, nullptr);
    case Dtype::kFloat64: return fwd_impl<double, double, false>(params, nullptr, nullptr);
    case Dtype::kFloat16: return fwd_impl<c10::Half, float, false>(params, nullptr, nullptr);
    case Dtype::kBFloat16: return fwd_impl<c10::BFloat16, float, false>(params, nullptr, nullptr);
  }
}

void run_mha_bwd_cpu(const Flash_bwd_params& params, Dtype dtype) {
  switch (dtype) {
    case Dtype::kFloat32: return bwd_impl<float, double>(params);
    case Dtype::kFloat64: return bwd_impl<double, double>(params);
    case Dtype::kFloat16: return bwd_impl<c10::Half, float>(params);
    case Dtype::kBFloat16: return bwd_impl<c10::BFloat16, float>(params);
  }
}

}  // namespace cpu
}  // namespace flash
