// bf16 linear layers on AMX tiles: y[M, N] = bf16(x)[M, K] . W^T (+ bias), x and y float32, W bf16.
//
// Batch invariance by construction (exact resume, docs/benchmarks-robustness.md): every output
// element y[m][n] is summed by exactly one chain of _tile_dpbf16ps over K, k = 0, 32, 64, ... in
// that order, into one float32 accumulator tile that stays in a tile register for the whole K loop
// and is stored once. A tile dot product computes C[m][n] from row m of A and column n of B only,
// so y[m][n] depends on x's row m and W alone: not on M, on the row's position, on which rows share
// its tile, or on the thread split (threads split the work over (row block, column block) pairs,
// never over K). oneDNN's AMX GEMM sums in another order above 32 rows (amx_linear.py), hence this.
//
// Layout:
// * W [N, K] is packed once (pack_amx_bf16) into blocks [Np / 16][Kp / 32][16][16][2] bf16, Np and
//   Kp N and K rounded up to 16 and 32, padding zero: block (nb, kb) is the B tile of columns
//   16 nb .. 16 nb + 15 and k 32 kb .. 32 kb + 31 in the VNNI pair layout the tiles read (row i:
//   for each of the 16 columns, w[n][32 kb + 2i] and w[n][32 kb + 2i + 1]), 1 KiB, contiguous.
// * x is rounded to bf16 (round to nearest even, vcvtneps2bf16) once per call into [M][Kp], k
//   padding zero (0 * 0 = 0: padding adds exact zeros to every sum).
// * Register blocking: 2 x 2 float32 C tiles (32 rows x 32 columns), 2 A tiles and 2 B tiles; for
//   each k step two A and two B tile loads feed four tile dot products. A row block's last tiles
//   have the rows left (a second tile configuration, rows < 16), so no work is done on padding rows;
//   column blocks past N compute on zero weights and are not stored.
// * Order: one task = one 32 x 32 block; tasks run column super-blocks (SB_BYTES of weights, from
//   L2) outer, then row blocks, then the super-block's column blocks, so a thread's consecutive
//   tasks reuse one row block's activations from L1 and the super-block's weights from L2.
// * Prefetch: with at most PF_MBLOCKS row blocks (decode steps, the LM head) every task reads
//   weights no task before it read, straight from memory, and the tile loads alone keep too few
//   reads in flight; so during a task's K loop the weights of the task PF_TASKS ahead (the same
//   thread's) are prefetched into L2, 2 KiB per k step (the block's size / the k steps). A
//   prefetch changes no arithmetic.
//
// The output is float32, straight from the accumulators: not rounded to bf16 (oneDNN's path rounds
// its output to bf16 and widens it again). The only rounding beyond float32 summation is that of
// x and W to bf16.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include "cpu_check.h"

#include <cstdint>
#include <cstring>
#include <algorithm>
#include <mutex>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LOCKGATE_AMX_BF16 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t TK = 32;  // k per tile step: 16 pairs of bf16 (64 bytes per tile row)
constexpr int64_t TN = 16;  // columns per tile
constexpr int64_t TM = 16;  // rows per tile
constexpr int64_t BM = 32, BN = 32;  // rows and columns per task: 2 x 2 C tiles
// Weight bytes per column super-block: tasks run row blocks over the column blocks of one
// super-block, so its weights stay in L2 (2 MiB per core on Sapphire Rapids) while the activations'
// row blocks pass; best of 256 KiB - all of N on this host's shapes (docs/design.md).
constexpr int64_t SB_BYTES = 1 << 20;
// Prefetch (above): for calls of at most this many row blocks, this many tasks ahead. Measured on
// the model's decode shapes, 1 thread: 15-20 % less time per pass at 1-32 rows; 1, 2 and 4 tasks
// ahead and L1 vs L2 as the target within noise of each other (docs/benchmarks.md).
constexpr int64_t PF_MBLOCKS = 2;
constexpr int64_t PF_TASKS = 2;

inline int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

#ifdef LOCKGATE_AMX_BF16

// Linux keeps the 8 KiB tile data out of a thread's saved state until the process asks for it
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); a tile instruction before that faults.
// Once per process; torch's oneDNN asks the same, and asking twice is harmless.
bool request_tiles() {
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
    constexpr int XFEATURE_XTILEDATA = 18;
    ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  });
  return ok;
}

// The palette-1 tile configuration (64 bytes, the layout _tile_loadconfig reads).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 C of the top 16 rows (columns 0-15, 16-31), 2, 3 C of the bottom rows, 4 A top,
// 5 A bottom, 6, 7 B (columns 0-15, 16-31). ``top`` and ``bottom`` are the rows of each half
// (bottom 0: the half is not configured and not used).
TileConfig tile_config(int top, int bottom) {
  TileConfig c;
  auto set = [&](int t, int rows, int colsb) { c.rows[t] = static_cast<uint8_t>(rows); c.colsb[t] = static_cast<uint16_t>(colsb); };
  set(0, top, TN * 4);
  set(1, top, TN * 4);
  set(4, top, TK * 2);
  if (bottom > 0) {
    set(2, bottom, TN * 4);
    set(3, bottom, TN * 4);
    set(5, bottom, TK * 2);
  }
  set(6, TK / 2, TN * 4);
  set(7, TK / 2, TN * 4);
  return c;
}

// One C tile's rows out of the tile buffer into y (masked past N), the bias added in float32.
inline void store_c(const float* buf, int rows, float* y, int64_t ldy, int64_t cols, const float* bias) {
  const __mmask16 mk = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mk, bias) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r)
    _mm512_mask_storeu_ps(y + r * ldy, mk, _mm512_add_ps(_mm512_loadu_ps(buf + r * TN), b));
}

template <bool BOTTOM>
inline void block(const uint16_t* a, int64_t lda_bytes, const uint16_t* w0, const uint16_t* w1, int64_t kb,
                  float* y, int64_t ldy, int64_t cols, int top, int bottom, const float* bias,
                  const char* pf) {
  _tile_zero(0);
  _tile_zero(1);
  if (BOTTOM) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const char* a0 = reinterpret_cast<const char*>(a);
  const char* a1 = a0 + TM * lda_bytes;
  // Fixed order over K for every element: k block 0, 1, 2, ... each one dot product step.
  for (int64_t k = 0; k < kb; ++k) {
    if (pf != nullptr) {  // another task's weights, 2 KiB per k step: its two panels, kb KiB each
      const char* p = pf + k * 2 * TK * TN * 2;
#pragma GCC unroll 32
      for (int64_t i = 0; i < 2 * TK * TN * 2; i += 64) _mm_prefetch(p + i, _MM_HINT_T1);
    }
    _tile_loadd(6, w0 + k * TK * TN, TN * 4);
    _tile_loadd(7, w1 + k * TK * TN, TN * 4);
    _tile_loadd(4, a0 + k * TK * 2, lda_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (BOTTOM) {
      _tile_loadd(5, a1 + k * TK * 2, lda_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float buf[TM * TN];
  // Column halves past N computed on zero weights: not stored.
  _tile_stored(0, buf, TN * 4);
  store_c(buf, top, y, ldy, cols, bias);
  if (cols > TN) {
    _tile_stored(1, buf, TN * 4);
    store_c(buf, top, y + TN, ldy, cols - TN, bias ? bias + TN : nullptr);
  }
  if (BOTTOM) {
    _tile_stored(2, buf, TN * 4);
    store_c(buf, bottom, y + TM * ldy, ldy, cols, bias);
    if (cols > TN) {
      _tile_stored(3, buf, TN * 4);
      store_c(buf, bottom, y + TM * ldy + TN, ldy, cols - TN, bias ? bias + TN : nullptr);
    }
  }
}

// x [M, K] float32 -> [M, Kp] bf16 (round to nearest even), k padding zero.
void round_x(const float* x, int64_t M, int64_t K, int64_t Kp, uint16_t* out) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * K;
      uint16_t* o = out + m * Kp;
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + k)));
      if (k < K) {
        const __mmask16 mk = static_cast<__mmask16>((1u << (K - k)) - 1);
        _mm256_mask_storeu_epi16(o + k, mk, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mk, xr + k)));
        k = K;
      }
      for (; k < Kp; ++k) o[k] = 0;
    }
  });
}

#endif  // LOCKGATE_AMX_BF16

}  // namespace

bool amx_bf16_built() {
#ifdef LOCKGATE_AMX_BF16
  return request_tiles();
#else
  return false;
#endif
}

// W [N, K] (float32 or bf16) -> the tile blocks described above, as an int16 tensor of the bf16 bits.
at::Tensor pack_amx_bf16(at::Tensor w) {
  check_cpu("w", w);
  TORCH_CHECK(w.dim() == 2, "pack_amx_bf16: w must be [N, K], got ", w.dim(), " dims");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N > 0 && K > 0, "pack_amx_bf16: empty weight [", N, ", ", K, "]");
  const int64_t Np = round_up(N, BN), Kp = round_up(K, TK);
  auto wb = w.to(at::kBFloat16).contiguous();
  auto out = at::zeros({Np / TN, Kp / TK, TK / 2, TN, 2}, at::kShort);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wb.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<int16_t>());
  const int64_t kbs = Kp / TK;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t nb = n / TN, kb = k / TK, i = (k % TK) / 2;
      dst[(((nb * kbs + kb) * (TK / 2) + i) * TN + n % TN) * 2 + (k & 1)] = src[n * K + k];
    }
  return out;
}

at::Tensor linear_amx_bf16(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias) {
  check_cpu("x", x, "packed", packed, "bias", bias);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "linear_amx_bf16: x must be a contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kShort && packed.is_contiguous(),
              "linear_amx_bf16: packed must come from pack_amx_bf16");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t Np = packed.size(0) * TN, Kp = packed.size(1) * TK;
  TORCH_CHECK(Kp == round_up(K, TK) && n > 0 && Np == round_up(n, BN),
              "linear_amx_bf16: packed weight is for another shape than x's K = ", K, " and n = ", n);
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "linear_amx_bf16: bias must be contiguous float32 [n]");
  }
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;
#ifdef LOCKGATE_AMX_BF16
  TORCH_CHECK(request_tiles(), "linear_amx_bf16: the OS refused AMX tile data (arch_prctl XTILEDATA)");
  auto xb = at::empty({M, Kp}, x.options().dtype(at::kShort));
  uint16_t* xa = reinterpret_cast<uint16_t*>(xb.data_ptr<int16_t>());
  round_x(x.data_ptr<float>(), M, K, Kp, xa);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
  float* yp = y.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t mblocks = (M + BM - 1) / BM, nblocks = Np / BN, kb = Kp / TK;
  const int64_t panel = kb * TK * TN;  // bf16 per 16-column panel
  const int last_rows = static_cast<int>(M - (mblocks - 1) * BM);
  const int64_t SB = std::max<int64_t>(1, std::min<int64_t>(nblocks, SB_BYTES / (BN * Kp * 2)));
  // task -> (row block, column block): column super-blocks outer, row blocks, the super-block's columns
  auto task_blocks = [&](int64_t t, int64_t& mb, int64_t& nbk) {
    const int64_t s = t / (mblocks * SB), in_s = t - s * mblocks * SB;
    const int64_t width = nblocks - s * SB < SB ? nblocks - s * SB : SB;
    mb = in_s / width;
    nbk = s * SB + in_s % width;
  };
  at::parallel_for(0, mblocks * nblocks, 1, [&](int64_t t0, int64_t t1) {
    // Tile state is per thread: configure here, release when done.
    const TileConfig full = tile_config(TM, TM);
    const TileConfig tail = tile_config(last_rows < TM ? last_rows : TM, last_rows > TM ? last_rows - TM : 0);
    const TileConfig* loaded = nullptr;
    for (int64_t t = t0; t < t1; ++t) {
      int64_t mb, nbk;
      task_blocks(t, mb, nbk);
      const bool is_tail = mb == mblocks - 1 && last_rows < BM;
      const TileConfig* want = is_tail ? &tail : &full;
      if (loaded != want) {
        _tile_loadconfig(want);
        loaded = want;
      }
      const int top = is_tail ? (last_rows < TM ? last_rows : TM) : TM;
      const int bottom = is_tail ? (last_rows > TM ? last_rows - TM : 0) : TM;
      const int64_t col = nbk * BN;
      const int64_t cols = n - col < BN ? n - col : BN;
      const uint16_t* w0 = wp + (2 * nbk) * panel;
      const char* pf = nullptr;
      if (mblocks <= PF_MBLOCKS && t + PF_TASKS < t1) {
        int64_t mb2, nb2;
        task_blocks(t + PF_TASKS, mb2, nb2);
        if (nb2 != nbk) pf = reinterpret_cast<const char*>(wp + (2 * nb2) * panel);
      }
      const uint16_t* a = xa + mb * BM * Kp;
      float* yb = yp + mb * BM * n + col;
      const float* bb = bp ? bp + col : nullptr;
      if (bottom > 0)
        block<true>(a, Kp * 2, w0, w0 + panel, kb, yb, n, cols, top, bottom, bb, pf);
      else
        block<false>(a, Kp * 2, w0, w0 + panel, kb, yb, n, cols, top, bottom, bb, pf);
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "linear_amx_bf16: this build has no AMX tiles (built without -mamx-tile -mamx-bf16)");
#endif
  return y;
}
