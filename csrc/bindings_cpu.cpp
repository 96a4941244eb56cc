// The torch registration of fp8ops._cpu, the emulation's CPU kernels (kernels_cpu.h). These are
// internal ops of the emulation (torch.ops.fp8ops_cpu), not the public fp8ops ops.
#include <Python.h>
#include <torch/library.h>

#include "kernels_cpu.h"

TORCH_LIBRARY(fp8ops_cpu, m) {
  m.def("stochastic_round(Tensor y, ScalarType dtype, int seed_lo, int seed_hi, int offset_lo, int offset_hi) -> Tensor");
  m.def("quantize_mx(Tensor x, ScalarType dtype, int block_size, int axis, bool rceil) -> (Tensor, Tensor)");
  m.def("tile_amax(Tensor x, int block_rows, int block_cols) -> Tensor");
  m.def("cast_tiles(Tensor x, Tensor mult, int block_rows, int block_cols, ScalarType dtype) -> Tensor");
  m.def("cast_stats(Tensor x, Tensor data, Tensor scale_inv, int block_rows, int block_cols) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fp8ops_cpu, CPU, m) {
  m.impl("stochastic_round", &fp8ops_cpu::stochastic_round_cpu);
  m.impl("quantize_mx", &fp8ops_cpu::quantize_mx_cpu);
  m.impl("tile_amax", &fp8ops_cpu::tile_amax_cpu);
  m.impl("cast_tiles", &fp8ops_cpu::cast_tiles_cpu);
  m.impl("cast_stats", &fp8ops_cpu::cast_stats_cpu);
}

// Importing the module loads the library, whose static initializers register the ops above.
extern "C" PyObject* PyInit__cpu(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
