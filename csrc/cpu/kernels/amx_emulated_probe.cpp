// Test hooks into the AMX model (amx_emulated.h), in the isa_amx_emulated build only: single
// instructions with chosen configurations and operands (tests/test_cpu_amx.py checks the model's
// arithmetic and that each wrong use faults), and other code's use of the tiles between two calls.
#if defined(PAGED_CPU_AMX_EMULATED)
#include <ATen/core/Tensor.h>
#include <omp.h>

#include <cstring>
#include <string>

#include "cpu/amx_emulated.h"
#include "cpu/isa.h"

namespace paged::cpu::PAGED_CPU_ISA_NS {
namespace {

using amx_emulated::TileConfig;

TileConfig config(std::initializer_list<std::pair<int, int>> shapes) {  // (rows, colsb) of tmm0, tmm1, ...
  TileConfig c{};
  c.palette_id = 1;
  int t = 0;
  for (auto [rows, colsb] : shapes) c.rows[t] = uint8_t(rows), c.colsb[t++] = uint16_t(colsb);
  return c;
}

}  // namespace

// Runs the named wrong use on this thread and returns the fault it raised ("" if none).
std::string amx_emulated_fault_case(const std::string& name) {
  namespace emu = amx_emulated;
  emu::take_fault();
  emu::tilerelease();
  alignas(64) float buf[16 * 16] = {};
  TileConfig ok = config({{16, 64}, {16, 64}, {16, 64}, {8, 64}, {16, 32}});
  auto load = [&](TileConfig c) { emu::ldtilecfg(&c); };
  if (name == "no_config") {
    emu::tilezero(0);
  } else if (name == "after_release") {
    load(ok), emu::tilezero(0), emu::tilerelease(), emu::tilezero(0);
  } else if (name == "valid") {  // a correct sequence: must not fault
    load(ok), emu::tilezero(0), emu::tileloadd(1, buf, 64), emu::tileloadd(2, buf, 64);
    emu::tdpbf16ps(0, 1, 2), emu::tilestored(0, buf, 64);
  } else if (name.rfind("config_", 0) == 0) {
    TileConfig c = ok;
    if (name == "config_palette0") c.palette_id = 0;
    if (name == "config_palette2") c.palette_id = 2;
    if (name == "config_start_row") c.start_row = 1;
    if (name == "config_reserved") c.reserved[3] = 1;
    if (name == "config_rows17") c.rows[0] = 17;
    if (name == "config_colsb68") c.colsb[0] = 68;
    if (name == "config_colsb6") c.colsb[4] = 6;
    if (name == "config_rows_without_colsb") c.colsb[5] = 0, c.rows[5] = 4;
    if (name == "config_tile8") c.rows[8] = 16, c.colsb[8] = 64;
    load(c);
  } else if (name == "load_unconfigured_tile") {
    load(ok), emu::tileloadd(6, buf, 64);
  } else if (name == "store_unconfigured_tile") {
    load(ok), emu::tilestored(7, buf, 64);
  } else if (name == "tile_number_8") {
    volatile int eight = 8;  // not a constant: GCC would warn of the write the model refuses
    load(ok), emu::tilezero(eight);
  } else if (name == "store_unwritten") {
    load(ok), emu::tilestored(0, buf, 64);
  } else if (name == "dot_unwritten_c") {
    load(ok), emu::tileloadd(1, buf, 64), emu::tileloadd(2, buf, 64), emu::tdpbf16ps(0, 1, 2);
  } else if (name.rfind("dot_", 0) == 0) {
    // tmm0 16x64, tmm1 16x64, tmm2 16x64, tmm3 8x64, tmm4 16x32: every tile written first.
    load(ok);
    for (int t = 0; t < 5; ++t) emu::tilezero(t);
    if (name == "dot_rows") emu::tdpbf16ps(3, 1, 2);  // A.rows 16 != C.rows 8
    if (name == "dot_k") emu::tdpbf16ps(0, 1, 3);     // A.colsb / 4 = 16 != B.rows 8
    if (name == "dot_n") emu::tdpbf16ps(4, 1, 2);     // B.colsb 64 != C.colsb 32
    if (name == "dot_same_tile") emu::tdpbf16ps(0, 0, 2);
  } else {
    TORCH_CHECK_VALUE(false, "amx_emulated_fault: no case '", name, "'");
  }
  emu::tilerelease();
  return emu::take_fault();
}

// One TDPBF16PS: C [M][N] fp32 += A [M][K] pairs . B [K][N] pairs (int32 words holding two bf16),
// M, K <= 16, N <= 16; returns the new C (or raises the fault).
at::Tensor amx_emulated_tdpbf16ps(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b) {
  namespace emu = amx_emulated;
  TORCH_CHECK_VALUE(c.dim() == 2 && a.dim() == 2 && b.dim() == 2 && c.scalar_type() == at::kFloat &&
                        a.scalar_type() == at::kInt && b.scalar_type() == at::kInt,
                    "amx_emulated_tdpbf16ps: c float32 [M][N], a int32 [M][K], b int32 [K][N]");
  const at::Tensor cc = c.contiguous().clone(), ac = a.contiguous(), bc = b.contiguous();
  TileConfig cfg = config({{int(cc.size(0)), int(cc.size(1)) * 4}, {int(ac.size(0)), int(ac.size(1)) * 4},
                           {int(bc.size(0)), int(bc.size(1)) * 4}});
  emu::take_fault();
  emu::ldtilecfg(&cfg);
  emu::tileloadd(0, cc.data_ptr(), cc.size(1) * 4);
  emu::tileloadd(1, ac.data_ptr(), ac.size(1) * 4);
  emu::tileloadd(2, bc.data_ptr(), bc.size(1) * 4);
  emu::tdpbf16ps(0, 1, 2);
  emu::tilestored(0, cc.data_ptr(), cc.size(1) * 4);
  emu::tilerelease();
  const std::string fault = emu::take_fault();
  TORCH_CHECK(fault.empty(), fault);
  return cc;
}

// What other code on the kernel threads may do between two calls: "release" the tiles, or load
// a "foreign" configuration of its own (every tile 1 row x 4 bytes).
void amx_emulated_disturb(const std::string& how) {
  TORCH_CHECK_VALUE(how == "release" || how == "foreign", "amx_emulated_disturb: 'release' or 'foreign'");
#pragma omp parallel
  {
    if (how == "release") {
      amx_emulated::tilerelease();
    } else {
      TileConfig c = config({{1, 4}, {1, 4}, {1, 4}, {1, 4}, {1, 4}, {1, 4}, {1, 4}, {1, 4}});
      amx_emulated::ldtilecfg(&c);
    }
  }
}

int64_t amx_emulated_dot_count() { return amx_emulated::g_dot_count.load(); }

}  // namespace paged::cpu::PAGED_CPU_ISA_NS
#endif
