/*
 * cpu_generic.c -- the loop bodies of cpu_loops_impl.h for the baseline instruction set of the
 * target (SSE2 on x86-64), the table used on every CPU and the only one off x86.
 */
#define TM_ISA_SUFFIX generic
#include "cpu_loops_impl.h"
