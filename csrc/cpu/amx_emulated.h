// A scalar model of the AMX instructions amx_dot.h uses (LDTILECFG, TILELOADD, TILESTORED,
// TILEZERO, TDPBF16PS; TILERELEASE for the tests), for the isa_amx_emulated build: the same tile
// kernels compiled on it run, and are tested, on a CPU without AMX. Written from the pseudocode of
// Intel's SDM (vol. 2: the instructions' Operation sections, 2.10's AMX exception classes), not from
// hardware: what it proves is that the kernels' configs, shapes, strides and layouts are what the
// instructions define, and its numbers are the SDM's arithmetic; timing, the OS's permission path
// (arch_prctl) and hardware rounding corners the SDM leaves unsaid are not modelled.
//
// State is per thread, as the tile registers are per logical processor: a configuration (palette
// 1: 8 tiles of at most 16 rows x 64 bytes) and 8 tiles of data. Arithmetic (TDPBF16PS, per the
// SDM): per output row, two fp32 sums per column, one over the even bf16 of each pair and one
// over the odd, each step one fp32 FMA with round-to-nearest-even; then the two are added and
// added to C. bf16 inputs (and C) are read with denormals as zero, every result flushed to zero
// when denormal; MXCSR plays no part.
//
// Faults. What the hardware rejects (#GP at LDTILECFG, #UD = SIGILL at a tile instruction) is a
// fault here too, and so is more, where the kernels can only be wrong (marked "stricter"):
//   LDTILECFG  palette other than 1 (0 would release the tiles: the kernels never mean that),
//              start_row != 0 (stricter: only the OS's restart of a faulted load sets it), reserved
//              bytes, rows > 16, colsb > 64, one of rows/colsb 0 without the other, tiles 8..15
//              configured, colsb not a multiple of 4 (stricter: every element here is a dword)
//   any tile instruction: no configuration loaded on this thread (never, or since TILERELEASE),
//              a tile number outside 0..7, a tile the configuration leaves unconfigured (rows 0)
//   TDPBF16PS  the same tile twice, A.rows != C.rows, A.colsb / 4 != B.rows, B.colsb != C.colsb
//   reads      a tile read (TILESTORED, TDPBF16PS's A, B or C) that nothing wrote since LDTILECFG
//              (stricter: the hardware zeroes tiles at LDTILECFG, but a kernel that keeps its
//              configuration across calls cannot count on that zero)
// A fault is recorded (the first one per call, with the instruction and the reason), the faulting
// instruction does nothing (no memory is touched), and take_fault() hands it to the op, which
// raises it as a RuntimeError after the kernel (an exception cannot leave an OpenMP region).
#pragma once
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

namespace paged::cpu::PAGED_CPU_ISA_NS::amx_emulated {

inline constexpr int kTiles = 8, kMaxRows = 16, kMaxColsb = 64;  // palette 1

// LDTILECFG's 64-byte memory operand.
struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes per row
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64);

struct ThreadState {
  bool configured = false;
  TileConfig config{};
  bool written[kTiles] = {};  // since the last LDTILECFG
  alignas(64) uint8_t data[kTiles][kMaxRows][kMaxColsb] = {};
};
inline thread_local ThreadState t_tiles;

// TDPBF16PS executed, all threads: tests check that a case took the tile path.
inline std::atomic<int64_t> g_dot_count{0};

inline std::mutex g_fault_mutex;
inline std::string g_fault;  // the first fault not yet taken
inline std::atomic<bool> g_has_fault{false};

[[gnu::cold]] inline void fault(const std::string& instruction, const std::string& what) {
  std::lock_guard<std::mutex> lock(g_fault_mutex);
  if (g_fault.empty()) g_fault = "amx_emulated: " + instruction + ": " + what;
  g_has_fault.store(true, std::memory_order_release);
}

// The first fault since the last call ("" if none), cleared.
inline std::string take_fault() {
  if (!g_has_fault.load(std::memory_order_acquire)) return {};
  std::lock_guard<std::mutex> lock(g_fault_mutex);
  std::string f;
  f.swap(g_fault);
  g_has_fault.store(false, std::memory_order_release);
  return f;
}

inline std::string tmm(int t) { return "tmm" + std::to_string(t); }
inline std::string shape(int t) {
  const TileConfig& c = t_tiles.config;
  return tmm(t) + " (" + std::to_string(c.rows[t]) + " rows x " + std::to_string(c.colsb[t]) + " bytes)";
}

// Whether tile t may be used by the instruction (else the fault is recorded).
inline bool usable(const char* instruction, int t) {
  if (!t_tiles.configured) {
    fault(instruction, "no tile configuration loaded on this thread (LDTILECFG never ran here, or TILERELEASE "
                       "since): the hardware raises #UD");
    return false;
  }
  if (t < 0 || t >= kTiles) {
    fault(instruction, "tile " + std::to_string(t) + " does not exist (palette 1 has tmm0..tmm7): #UD");
    return false;
  }
  if (t_tiles.config.rows[t] == 0) {
    fault(instruction, tmm(t) + " is not configured (0 rows in the loaded configuration): #UD");
    return false;
  }
  return true;
}

inline bool was_written(const char* instruction, int t, const char* role) {
  if (t_tiles.written[t]) return true;
  fault(instruction, std::string(role) + " " + tmm(t) +
                         " read, but nothing wrote it since LDTILECFG (stricter than the hardware, which zeroes "
                         "tiles there: a kernel keeping its configuration across calls cannot count on it)");
  return false;
}

inline void ldtilecfg(const void* mem) {
  constexpr const char* kI = "LDTILECFG";
  TileConfig c;
  std::memcpy(&c, mem, sizeof(c));
  if (c.palette_id != 1) {
    fault(kI, "palette " + std::to_string(c.palette_id) +
                  (c.palette_id == 0 ? " (would release the tiles; the kernels configure palette 1 only)"
                                     : " is not supported (palette 1 only): #GP"));
    return;
  }
  if (c.start_row != 0) {
    fault(kI, "start_row " + std::to_string(c.start_row) +
                  " (stricter: only the restart of a faulted TILELOADD/TILESTORED sets it)");
    return;
  }
  for (int i = 0; i < 14; ++i)
    if (c.reserved[i] != 0) {
      fault(kI, "reserved byte " + std::to_string(2 + i) + " is not 0: #GP");
      return;
    }
  for (int t = 0; t < 16; ++t) {
    const int rows = c.rows[t], colsb = c.colsb[t];
    const std::string what = tmm(t) + " rows " + std::to_string(rows) + ", colsb " + std::to_string(colsb) + ": ";
    if (t >= kTiles && (rows != 0 || colsb != 0)) {
      fault(kI, what + "palette 1 has 8 tiles, the others must be 0: #GP");
      return;
    }
    if (rows > kMaxRows || colsb > kMaxColsb) {
      fault(kI, what + "over palette 1's 16 rows x 64 bytes: #GP");
      return;
    }
    if ((rows == 0) != (colsb == 0)) {
      fault(kI, what + "a tile has both or neither: #GP");
      return;
    }
    if (colsb % 4 != 0) {
      fault(kI, what + "not a multiple of 4 bytes (stricter: every tile here holds dwords)");
      return;
    }
  }
  t_tiles.configured = true;
  t_tiles.config = c;
  std::memset(t_tiles.data, 0, sizeof(t_tiles.data));
  std::memset(t_tiles.written, 0, sizeof(t_tiles.written));
}

inline void tilerelease() {
  t_tiles.configured = false;
  t_tiles.config = TileConfig{};
  std::memset(t_tiles.data, 0, sizeof(t_tiles.data));
  std::memset(t_tiles.written, 0, sizeof(t_tiles.written));
}

// Row r of the tile: colsb bytes from base + r * stride; the rest of the row and the rows past
// the configured ones are zero.
inline void tileloadd(int t, const void* base, int64_t stride) {
  if (!usable("TILELOADD", t)) return;
  const int rows = t_tiles.config.rows[t], colsb = t_tiles.config.colsb[t];
  std::memset(t_tiles.data[t], 0, sizeof(t_tiles.data[t]));
  for (int r = 0; r < rows; ++r)
    std::memcpy(t_tiles.data[t][r], static_cast<const uint8_t*>(base) + r * stride, size_t(colsb));
  t_tiles.written[t] = true;
}

inline void tilestored(int t, void* base, int64_t stride) {
  if (!usable("TILESTORED", t) || !was_written("TILESTORED", t, "source")) return;
  const int rows = t_tiles.config.rows[t], colsb = t_tiles.config.colsb[t];
  for (int r = 0; r < rows; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, t_tiles.data[t][r], size_t(colsb));
}

inline void tilezero(int t) {
  if (!usable("TILEZERO", t)) return;
  std::memset(t_tiles.data[t], 0, sizeof(t_tiles.data[t]));
  t_tiles.written[t] = true;
}

// fp32 with denormals read as zero (DAZ) / flushed to zero (FTZ), sign kept.
inline float denormal_to_zero(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.f, x) : x; }
inline float bf16_daz(uint16_t bits) {  // the SDM's make_fp32, then DAZ
  const uint32_t word = uint32_t(bits) << 16;
  float x;
  std::memcpy(&x, &word, sizeof(x));
  return denormal_to_zero(x);
}

inline void tdpbf16ps(int c, int a, int b) {
  constexpr const char* kI = "TDPBF16PS";
  const std::string operands = std::string(kI) + " " + tmm(c) + ", " + tmm(a) + ", " + tmm(b);
  if (!usable(kI, c) || !usable(kI, a) || !usable(kI, b)) return;
  if (c == a || c == b || a == b) {
    fault(operands, "the three tiles must differ: #UD");
    return;
  }
  const TileConfig& cfg = t_tiles.config;
  if (cfg.rows[a] != cfg.rows[c]) {
    fault(operands, "A.rows != C.rows: A " + shape(a) + ", C " + shape(c) + ": #UD");
    return;
  }
  if (cfg.colsb[a] / 4 != cfg.rows[b]) {
    fault(operands, "A.colsb / 4 != B.rows: A " + shape(a) + ", B " + shape(b) + ": #UD");
    return;
  }
  if (cfg.colsb[b] != cfg.colsb[c]) {
    fault(operands, "B.colsb != C.colsb: B " + shape(b) + ", C " + shape(c) + ": #UD");
    return;
  }
  if (!was_written(kI, c, "C") || !was_written(kI, a, "A") || !was_written(kI, b, "B")) return;
  g_dot_count.fetch_add(1, std::memory_order_relaxed);

  const int M = cfg.rows[c], K = cfg.colsb[a] / 4, N = cfg.colsb[c] / 4;
  float bf[kMaxRows][2 * kMaxColsb / 4];  // B as fp32 (DAZ): row k, bf16 element 2n + i
  for (int k = 0; k < K; ++k)
    for (int e = 0; e < 2 * N; ++e) {
      uint16_t bits;
      std::memcpy(&bits, &t_tiles.data[b][k][2 * e], 2);
      bf[k][e] = bf16_daz(bits);
    }
  for (int m = 0; m < M; ++m) {
    float af[2 * kMaxColsb / 4];
    for (int e = 0; e < 2 * K; ++e) {
      uint16_t bits;
      std::memcpy(&bits, &t_tiles.data[a][m][2 * e], 2);
      af[e] = bf16_daz(bits);
    }
    float even[kMaxColsb / 4] = {}, odd[kMaxColsb / 4] = {};  // the SDM's temp1.fp32[2n], [2n + 1]
    for (int k = 0; k < K; ++k)
      for (int n = 0; n < N; ++n) {
        even[n] = denormal_to_zero(std::fma(af[2 * k], bf[k][2 * n], even[n]));
        odd[n] = denormal_to_zero(std::fma(af[2 * k + 1], bf[k][2 * n + 1], odd[n]));
      }
    float* row = reinterpret_cast<float*>(t_tiles.data[c][m]);
    for (int n = 0; n < N; ++n) {
      float dst;
      std::memcpy(&dst, &row[n], sizeof(dst));
      const float pair_sum = denormal_to_zero(even[n] + odd[n]);
      dst = denormal_to_zero(denormal_to_zero(dst) + pair_sum);
      std::memcpy(&row[n], &dst, sizeof(dst));
    }
    std::memset(t_tiles.data[c][m] + 4 * N, 0, size_t(kMaxColsb - 4 * N));  // write_row_and_zero
  }
  for (int m = M; m < kMaxRows; ++m) std::memset(t_tiles.data[c][m], 0, kMaxColsb);  // zero_upper_rows
}

}  // namespace paged::cpu::PAGED_CPU_ISA_NS::amx_emulated
