/*
 * cpu_avx2.c -- the loop bodies of cpu_loops_impl.h compiled with -mavx2 -mfma -mf16c (8 float
 * lanes). Off x86 this file defines nothing, and cpu_features.c never names its table.
 * -mfma cannot change results: ISO C mode (-std=c11) keeps GCC from contracting a*b+c.
 */
#include "cpu_ops.h"

#if TM_CPU_X86
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "cpu_avx2.c must be compiled with -mavx2 -mfma -mf16c"
#endif
#define TM_ISA_SUFFIX avx2
#include "cpu_loops_impl.h"
#else
typedef int cpu_avx2_not_built; /* ISO C wants at least one declaration per file */
#endif
