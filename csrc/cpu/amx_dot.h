// The dot path's QK and PV on AMX-BF16 tiles (Sapphire Rapids and later), for the isa_amx build;
// isa_amx_emulated compiles this same code on the scalar model in amx_emulated.h. bf16_dot.h's
// entry points (dot_qk_rows / dot_pv_rows) hand each tile's rows here in blocks of 16 and do the
// rest (fewer than 16 rows) with vdpbf16ps. Why tiles: one TDPBF16PS is a [16 x 32] x [32 x 16]
// bf16 product into fp32, the work of 256 vdpbf16ps, so a prefill tile's QK and PV stop being
// bound by the AVX-512 dot products and their broadcasts; the layouts are bf16_dot.h's as they
// are (qb, kt, pb, vp, acc32: the tiles load them with a row stride, no re-layout). Numbers: each
// TDPBF16PS sums the even and the odd bf16 of its pairs apart, in fp32, then adds both to C
// (Intel SDM), so the sums differ in rounding from vdpbf16ps's, within the same bf16 tolerance.
//
// Tiles (palette 1, one configuration for QK and PV):
//   C0, C1   [16 rows][16 fp32]   QK: scores of tokens 0..15 / 16..31; PV: 32 columns of acc32
//   A        [16 rows][16 pairs]  QK: 16 query rows, 16 column pairs of qb; PV: 16 rows of pb
//   B0, B1   [16 pairs][16 dwords] QK: 16 column pairs of kt, tokens 0..15 / 16..31; PV: 16
//            token pairs of vp, 16 columns each
//   At, Bt0, Bt1  QK's last step when D / 2 is not a multiple of 16 (D = 80, 96, 72, ...): A with
//            `tail` pairs per row, B with `tail` rows; unconfigured when there is no tail
// The configuration depends only on the tail, and is loaded (LDTILECFG) once per thread per call
// and tail: every attention call starts a new epoch (begin_call), because between two calls any
// other code on the thread (oneDNN's AMX kernels in torch) may load its own or release the tiles.
// The tiles stay configured after the call (no TILERELEASE: the entry points do not know the
// task's end), which costs the OS a larger state save on a context switch.
#pragma once
#if defined(PAGED_CPU_AMX)
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(PAGED_CPU_AMX_EMULATED)
#include "amx_emulated.h"
#endif

namespace paged::cpu::PAGED_CPU_ISA_NS {

inline constexpr int kAmxTileTokens = 32;  // == kDotTileTokens (dot_qk_rows asserts it)

// Tile numbers: GCC's intrinsics paste them into the instruction text, so they are macros.
#define PAGED_AMX_C0 0
#define PAGED_AMX_C1 1
#define PAGED_AMX_A 2
#define PAGED_AMX_B0 3
#define PAGED_AMX_B1 4
#define PAGED_AMX_AT 5
#define PAGED_AMX_BT0 6
#define PAGED_AMX_BT1 7
// The instructions: Intel's intrinsics, or the scalar model's functions of the same meaning.
#if defined(PAGED_CPU_AMX_EMULATED)
#define PAGED_AMX_LOADCONFIG(config) amx_emulated::ldtilecfg(config)
#define PAGED_AMX_LOAD(t, base, stride) amx_emulated::tileloadd(t, base, stride)
#define PAGED_AMX_STORE(t, base, stride) amx_emulated::tilestored(t, base, stride)
#define PAGED_AMX_ZERO(t) amx_emulated::tilezero(t)
#define PAGED_AMX_DOT(c, a, b) amx_emulated::tdpbf16ps(c, a, b)
#else
#define PAGED_AMX_LOADCONFIG(config) _tile_loadconfig(config)
#define PAGED_AMX_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define PAGED_AMX_STORE(t, base, stride) _tile_stored(t, base, stride)
#define PAGED_AMX_ZERO(t) _tile_zero(t)
#define PAGED_AMX_DOT(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

// GCC's tile intrinsics are asm statements that name only the base address, not the memory
// behind it (and LDTILECFG only 8 of its 64 bytes): this barrier makes every store the caller
// made to the layouts and the configuration reach memory before the tiles read it.
inline void amx_memory_barrier() { asm volatile("" ::: "memory"); }

// LDTILECFG's operand, palette 1.
struct alignas(64) AmxTileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int tile_rows, int bytes_per_row) {
    rows[tile] = uint8_t(tile_rows);
    colsb[tile] = uint16_t(bytes_per_row);
  }
};

inline std::atomic<uint64_t> g_amx_epoch{1};
struct AmxLoaded {
  uint64_t epoch = 0;  // 0: nothing loaded by this code on this thread
  int tail = 0;
};
inline thread_local AmxLoaded t_amx_loaded;

// Called once per attention call, before its tasks run (kernels/attention.cpp).
inline void amx_begin_call() { g_amx_epoch.fetch_add(1, std::memory_order_relaxed); }

// Loads the configuration for QK steps with `tail` column pairs left over (0: none), unless this
// thread loaded it in this call already. any_tail: PV, which uses only the tiles all share.
inline void amx_configure(int tail, bool any_tail = false) {
  const uint64_t epoch = g_amx_epoch.load(std::memory_order_relaxed);
  if (t_amx_loaded.epoch == epoch && (any_tail || t_amx_loaded.tail == tail)) return;
  AmxTileConfig config;
  for (int t : {PAGED_AMX_C0, PAGED_AMX_C1, PAGED_AMX_A, PAGED_AMX_B0, PAGED_AMX_B1}) config.set(t, 16, 64);
  if (tail == 0) {  // no tail: all 8 tiles 16 x 64 bytes, as amx_qk_heads blocks them
    for (int t : {PAGED_AMX_AT, PAGED_AMX_BT0, PAGED_AMX_BT1}) config.set(t, 16, 64);
  } else {
    config.set(PAGED_AMX_AT, 16, tail * 4);
    config.set(PAGED_AMX_BT0, tail, 64);
    config.set(PAGED_AMX_BT1, tail, 64);
  }
  amx_memory_barrier();
  PAGED_AMX_LOADCONFIG(&config);
  t_amx_loaded = {epoch, tail};
}

// s[r][0..32) = scale * (q[r] . k[j]) for the first rows / 16 * 16 rows; returns how many.
// qb: [rows][DP] pairs, kt: [DP][32 tokens] pairs, s: [rows][32] fp32.
inline int64_t amx_qk_rows(int64_t rows, const uint32_t* qb, int DP, const uint32_t* kt, float scale, float* s) {
  const int64_t tiled = rows / 16 * 16;
  if (tiled == 0) return 0;
  const int steps = DP / 16, tail = DP % 16;  // K steps of 16 column pairs (32 columns), then the tail
  amx_configure(tail);
  amx_memory_barrier();
  const int64_t q_stride = int64_t(DP) * 4, k_stride = kAmxTileTokens * 4;
  for (int64_t r = 0; r < tiled; r += 16) {
    const uint32_t* q = qb + size_t(r) * DP;
    PAGED_AMX_ZERO(PAGED_AMX_C0);
    PAGED_AMX_ZERO(PAGED_AMX_C1);
    for (int step = 0; step < steps; ++step) {
      const uint32_t* k = kt + size_t(step) * 16 * kAmxTileTokens;
      PAGED_AMX_LOAD(PAGED_AMX_A, q + step * 16, q_stride);
      PAGED_AMX_LOAD(PAGED_AMX_B0, k, k_stride);
      PAGED_AMX_LOAD(PAGED_AMX_B1, k + 16, k_stride);
      PAGED_AMX_DOT(PAGED_AMX_C0, PAGED_AMX_A, PAGED_AMX_B0);
      PAGED_AMX_DOT(PAGED_AMX_C1, PAGED_AMX_A, PAGED_AMX_B1);
    }
    if (tail > 0) {
      const uint32_t* k = kt + size_t(steps) * 16 * kAmxTileTokens;
      PAGED_AMX_LOAD(PAGED_AMX_AT, q + steps * 16, q_stride);
      PAGED_AMX_LOAD(PAGED_AMX_BT0, k, k_stride);
      PAGED_AMX_LOAD(PAGED_AMX_BT1, k + 16, k_stride);
      PAGED_AMX_DOT(PAGED_AMX_C0, PAGED_AMX_AT, PAGED_AMX_BT0);
      PAGED_AMX_DOT(PAGED_AMX_C1, PAGED_AMX_AT, PAGED_AMX_BT1);
    }
    float* out = s + size_t(r) * kAmxTileTokens;
    PAGED_AMX_STORE(PAGED_AMX_C0, out, k_stride);
    PAGED_AMX_STORE(PAGED_AMX_C1, out + 16, k_stride);
  }
  // The scale on the fp32 scores, as qk_dot does (the bf16 query stays exact).
  const __m512 m = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < tiled * kAmxTileTokens; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), m));
  return tiled;
}

// Decode's QK with the heads as columns (attention.h's heads path, where every row of the task sees
// the same keys): S^T = K Q^T, st[j][r] = scale * (q[r] . k[j]), for n tokens (16 or 32) and `rows`
// query rows (a multiple of 16). A is 16 key rows read straight from the cache (or a gathered
// copy): keys[h] the first row of tokens 16h..16h+15, key_stride bytes between rows; B is Q^T in
// pairs, qt [rows / 16][DP][16 rows] (DP a multiple of 16: no tail); C is [16 tokens][16 rows].
// Why: the key rows are the A operand as they lie, so the tile needs no re-layout of K at all (the
// rows path transposes every tile's keys), and Q^T is laid out once per task. Blocking 2 x 2 (two
// token halves x two row blocks: 4 C, 2 A, 2 B, all 8 tiles of the tail-0 configuration): each
// step loads 4 tiles for 4 products. st: [32][rows] fp32.
#define PAGED_AMX_S00 0
#define PAGED_AMX_S01 1
#define PAGED_AMX_S10 5
#define PAGED_AMX_S11 6
#define PAGED_AMX_K0 2
#define PAGED_AMX_K1 7
#define PAGED_AMX_Q0 3
#define PAGED_AMX_Q1 4
inline void amx_qk_heads(int64_t rows, const uint32_t* qt, int DP, const void* const keys[2], const int64_t key_stride[2],
                         int n, float scale, float* st) {
  amx_configure(0);
  amx_memory_barrier();
  const bool two = n > 16;  // the second token half
  const int64_t st_stride = rows * 4;
  auto key_step = [&](int half, int step) { return static_cast<const char*>(keys[half]) + int64_t(step) * 64; };
  for (int64_t r = 0; r < rows; r += 32) {
    const bool pair = r + 16 < rows;  // a second row block
    const uint32_t* q0 = qt + size_t(r) * DP;
    const uint32_t* q1 = q0 + size_t(16) * DP;
    PAGED_AMX_ZERO(PAGED_AMX_S00);
    if (pair) PAGED_AMX_ZERO(PAGED_AMX_S01);
    if (two) PAGED_AMX_ZERO(PAGED_AMX_S10);
    if (two && pair) PAGED_AMX_ZERO(PAGED_AMX_S11);
    for (int step = 0; step < DP / 16; ++step) {
      PAGED_AMX_LOAD(PAGED_AMX_K0, key_step(0, step), key_stride[0]);
      PAGED_AMX_LOAD(PAGED_AMX_Q0, q0 + step * 256, 64);
      PAGED_AMX_DOT(PAGED_AMX_S00, PAGED_AMX_K0, PAGED_AMX_Q0);
      if (pair) {
        PAGED_AMX_LOAD(PAGED_AMX_Q1, q1 + step * 256, 64);
        PAGED_AMX_DOT(PAGED_AMX_S01, PAGED_AMX_K0, PAGED_AMX_Q1);
      }
      if (two) {
        PAGED_AMX_LOAD(PAGED_AMX_K1, key_step(1, step), key_stride[1]);
        PAGED_AMX_DOT(PAGED_AMX_S10, PAGED_AMX_K1, PAGED_AMX_Q0);
        if (pair) PAGED_AMX_DOT(PAGED_AMX_S11, PAGED_AMX_K1, PAGED_AMX_Q1);
      }
    }
    float* out = st + r;
    PAGED_AMX_STORE(PAGED_AMX_S00, out, st_stride);
    if (pair) PAGED_AMX_STORE(PAGED_AMX_S01, out + 16, st_stride);
    if (two) PAGED_AMX_STORE(PAGED_AMX_S10, out + 16 * rows, st_stride);
    if (two && pair) PAGED_AMX_STORE(PAGED_AMX_S11, out + 16 * rows + 16, st_stride);
  }
  // The scale on the fp32 scores, as amx_qk_rows does.
  const __m512 m = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < (two ? 32 : 16) * rows; i += 16) _mm512_storeu_ps(st + i, _mm512_mul_ps(_mm512_loadu_ps(st + i), m));
}

// acc32[r][c] += sum_j p[r][j] v[j][c] for the first rows / 16 * 16 rows over the whole tile;
// returns how many. pb: [rows][16 token pairs], vp: [16 token pairs][DV], acc32: [rows][DV] fp32
// (DV a multiple of 32; the columns from D on are zero in vp).
inline int64_t amx_pv_rows(int64_t rows, float* acc32, const uint32_t* pb, const uint32_t* vp, int DV) {
  const int64_t tiled = rows / 16 * 16;
  if (tiled == 0) return 0;
  amx_configure(0, /*any_tail=*/true);
  amx_memory_barrier();
  const int64_t stride = int64_t(DV) * 4;
  for (int64_t r = 0; r < tiled; r += 16) {
    PAGED_AMX_LOAD(PAGED_AMX_A, pb + size_t(r) * (kAmxTileTokens / 2), (kAmxTileTokens / 2) * 4);
    for (int c = 0; c < DV; c += 32) {
      float* out = acc32 + size_t(r) * DV + c;
      PAGED_AMX_LOAD(PAGED_AMX_C0, out, stride);
      PAGED_AMX_LOAD(PAGED_AMX_C1, out + 16, stride);
      PAGED_AMX_LOAD(PAGED_AMX_B0, vp + c, stride);
      PAGED_AMX_LOAD(PAGED_AMX_B1, vp + c + 16, stride);
      PAGED_AMX_DOT(PAGED_AMX_C0, PAGED_AMX_A, PAGED_AMX_B0);
      PAGED_AMX_DOT(PAGED_AMX_C1, PAGED_AMX_A, PAGED_AMX_B1);
      PAGED_AMX_STORE(PAGED_AMX_C0, out, stride);
      PAGED_AMX_STORE(PAGED_AMX_C1, out + 16, stride);
    }
  }
  return tiled;
}

}  // namespace paged::cpu::PAGED_CPU_ISA_NS
#endif
