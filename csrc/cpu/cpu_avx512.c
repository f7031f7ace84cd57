/*
 * cpu_avx512.c -- the loop bodies of cpu_loops_impl.h compiled with -mavx512f -mavx512bw
 * -mavx512vl -mavx2 -mfma -mf16c (16 float lanes, masked tails). Off x86 this file defines
 * nothing, and cpu_features.c never names its table.
 */
#include "cpu_ops.h"

#if TM_CPU_X86
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "cpu_avx512.c must be compiled with -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c"
#endif
#define TM_ISA_SUFFIX avx512
#include "cpu_loops_impl.h"
#else
typedef int cpu_avx512_not_built; /* ISO C wants at least one declaration per file */
#endif
