// What the torch bindings of every op family share: error text, argument checks, the current
// stream. The bindings (casts.cpp, gemm.cpp, optim.cpp) are fp8ops._C's only torch-aware C++;
// each registers its ops' CUDA kernels (TORCH_LIBRARY_IMPL(fp8ops, CUDA)).
#pragma once
#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>
#include <type_traits>

#include "../fp8ops.h"

namespace fp8ops_bind {

// Error text is built here with std::to_string, and TORCH_CHECK gets one finished string: an
// extension linked by a toolchain that copies parts of libstdc++ into it (devtoolset's
// libstdc++_nonshared.a) crashed (SIGSEGV in its own copy of ostream::_M_insert<long>) whenever a
// TORCH_CHECK message streamed a number (seen with torch 2.11 on an H100 machine).
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}
template <class... A>
inline std::string cat(const A&... parts) {
  std::string s;
  (append(s, parts), ...);
  return s;
}
#define FP8OPS_CHECK(cond, ...) TORCH_CHECK(cond, cat(__VA_ARGS__))

inline std::string shape_str(c10::ArrayRef<int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}
inline std::string shape_str(const at::Tensor& t) { return shape_str(t.sizes()); }
inline std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    case at::kFloat8_e5m2: return "float8_e5m2";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    default: return "dtype #" + std::to_string(static_cast<int>(t));
  }
}

inline fp8ops::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return fp8ops::DType::kFloat32;
    case at::kBFloat16: return fp8ops::DType::kBFloat16;
    case at::kHalf: return fp8ops::DType::kFloat16;
    case at::kFloat8_e4m3fn: return fp8ops::DType::kE4M3;
    case at::kFloat8_e5m2: return fp8ops::DType::kE5M2;
    case at::kByte: return fp8ops::DType::kUInt8;
    default: FP8OPS_CHECK(false, "fp8ops: unsupported dtype ", dtype_str(t));
  }
}

// The largest finite value of an FP8 dtype (E4M3 or E5M2).
inline float fp8_max_of(at::ScalarType dtype) { return dtype == at::kFloat8_e4m3fn ? 448.0f : 57344.0f; }

// A cast that takes its scale from the amax on the device (current scaling) and publishes the
// scale and its reciprocal: the QuantizeParams fields of that, as quantize_current sets them.
inline void take_scale_from_amax(fp8ops::QuantizeParams& p, const at::Tensor& amax, at::ScalarType dtype,
                                 double margin, bool power_of_two, const at::Tensor& scale,
                                 const at::Tensor& scale_inv) {
  p.scale_amax = amax.data_ptr<float>();
  p.fp8_max = fp8_max_of(dtype);
  p.margin = static_cast<float>(margin);
  p.power_of_two = power_of_two;
  p.out_scale = scale.data_ptr<float>();
  p.out_scale_inv = scale_inv.data_ptr<float>();
}

inline void check_cuda(const at::Tensor& t, const char* name) {
  FP8OPS_CHECK(t.is_cuda(), "fp8ops: ", name, " must be a CUDA tensor, got ", t.device().str());
}

inline void check_input(const at::Tensor& x, const char* name) {
  check_cuda(x, name);
  FP8OPS_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "fp8ops: ", name, " must be float32, bfloat16 or float16, got ", dtype_str(x.scalar_type()));
}

inline cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* na, const char* nb) {
  FP8OPS_CHECK(a.device() == b.device(), "fp8ops: ", na, " (", a.device().str(), ") and ", nb, " (",
              b.device().str(), ") must be on the same device");
}

}  // namespace fp8ops_bind
