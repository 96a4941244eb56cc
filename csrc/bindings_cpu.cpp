// The torch registration of fp8ops._cpu, the emulation's CPU kernels (kernels_cpu.h). These are
// internal ops of the emulation (torch.ops.fp8ops_cpu), not the public fp8ops ops.
#include <Python.h>
#include <torch/library.h>

#include "kernels_cpu.h"

TORCH_LIBRARY(fp8ops_cpu, m) {
  m.def("stochastic_round(Tensor y, ScalarType dtype, int seed_lo, int seed_hi, int offset_lo, int offset_hi, float scale=1.0) -> Tensor");
  m.def("quantize_mx(Tensor x, ScalarType dtype, int block_size, int axis, bool rceil) -> (Tensor, Tensor)");
  m.def("tile_amax(Tensor x, int block_rows, int block_cols) -> Tensor");
  m.def("cast_tiles(Tensor x, Tensor mult, int block_rows, int block_cols, ScalarType dtype) -> Tensor");
  m.def("cast_stats(Tensor x, Tensor data, Tensor scale_inv, int block_rows, int block_cols) -> (Tensor, Tensor)");
  m.def("quantize_tiles(Tensor x, ScalarType dtype, int block_rows, int block_cols, bool power_of_two) -> (Tensor, Tensor)");
  m.def("quantize_blockwise_pair(Tensor x, ScalarType dtype, bool power_of_two) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("abs_max(Tensor x) -> Tensor");
  m.def("cast_scaled(Tensor x, float scale, ScalarType dtype, bool transpose) -> (Tensor, Tensor)");
  m.def("decode_fp8(Tensor data, Tensor(a!) out) -> bool");
  m.def("dequantize_mx(Tensor data, Tensor scales, int block_size, Tensor(a!) out) -> bool");
  m.def("transpose_bytes(Tensor data) -> Tensor");
  m.def("gemm(Tensor a, Tensor b, Tensor alpha, Tensor? bias, Tensor(a!) af, Tensor(b!) bf) -> Tensor");
  m.def("gemm_blockwise(Tensor a, Tensor b, Tensor a_scale_inv, Tensor b_scale_inv, Tensor? bias, "
        "Tensor(a!) acc, Tensor(b!) af, Tensor(c!) bf, Tensor(d!) part) -> bool");
  m.def("gemm_mx(Tensor a, Tensor a_scales, Tensor b, Tensor b_scales, int block_size, Tensor? bias, "
        "Tensor(a!) acc, Tensor(b!) ad, Tensor(c!) bd) -> bool");
}

TORCH_LIBRARY_IMPL(fp8ops_cpu, CPU, m) {
  m.impl("stochastic_round", &fp8ops_cpu::stochastic_round_cpu);
  m.impl("quantize_mx", &fp8ops_cpu::quantize_mx_cpu);
  m.impl("tile_amax", &fp8ops_cpu::tile_amax_cpu);
  m.impl("cast_tiles", &fp8ops_cpu::cast_tiles_cpu);
  m.impl("cast_stats", &fp8ops_cpu::cast_stats_cpu);
  m.impl("quantize_tiles", &fp8ops_cpu::quantize_tiles_cpu);
  m.impl("quantize_blockwise_pair", &fp8ops_cpu::quantize_blockwise_pair_cpu);
  m.impl("abs_max", &fp8ops_cpu::abs_max_cpu);
  m.impl("cast_scaled", &fp8ops_cpu::cast_scaled_cpu);
  m.impl("decode_fp8", &fp8ops_cpu::decode_fp8_cpu);
  m.impl("dequantize_mx", &fp8ops_cpu::dequantize_mx_cpu);
  m.impl("transpose_bytes", &fp8ops_cpu::transpose_bytes_cpu);
  m.impl("gemm", &fp8ops_cpu::gemm_cpu);
  m.impl("gemm_blockwise", &fp8ops_cpu::gemm_blockwise_cpu);
  m.impl("gemm_mx", &fp8ops_cpu::gemm_mx_cpu);
}

// Importing the module loads the library, whose static initializers register the ops above.
extern "C" PyObject* PyInit__cpu(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
