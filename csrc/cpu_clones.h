// Build switches shared by the emulation's CPU kernels (csrc/*_cpu.cpp). Torch-free.
#pragma once

// One machine-code version per vector ISA, picked when the library loads (GCC's target_clones):
// the baseline x86-64 build has SSE2 only, whose missing unsigned max, blend and 64-bit lanes
// make these loops several times slower than with AVX2. The AVX-512 version takes the whole
// x86-64-v4 level (BW, DQ, VL with F): byte and word lanes, and AVX-512 on 256-bit vectors,
// without which the FP8 conversions compile to code no faster than AVX2's. Every version runs
// the same IEEE float32 and integer operations (no FMA contraction), so the bytes are the same.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define FP8OPS_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FP8OPS_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FP8OPS_CPU_CLONES
#endif
// Helpers inlined into a cloned function are compiled for its ISA.
#define FP8OPS_ALWAYS_INLINE __attribute__((always_inline)) inline
