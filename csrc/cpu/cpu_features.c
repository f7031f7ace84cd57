/*
 * cpu_features.c -- which CPU loop bodies run: the best table the processor and OS support
 * (AVX-512 > AVX2 > generic, via __builtin_cpu_supports, which also checks that the OS saves the
 * wide registers), or the one named by tm_cpu_select_isa (tests compare them; users may pin one).
 *
 * The active table is the library's only mutable global. It starts NULL and is set on first use
 * to the best table, so every entry point works even if nobody called select; it is atomic
 * because the first uses may come from several threads at once.
 */
#include <stdatomic.h>
#include <string.h>

#include "../common/tm_status.h"
#include "cpu_ops.h"

#if TM_CPU_X86
#include <cpuid.h>
#endif

static _Atomic(const cpu_kernels *) cpu_active = NULL;

#if TM_CPU_X86
/* F16C (the half <-> float conversions both wide tables use) from CPUID leaf 1: clang before 16
 * refuses "f16c" in __builtin_cpu_supports at compile time. Its registers are AVX's, whose OS
 * support the "avx2" check below already requires. */
static int
has_f16c(void)
{
    unsigned int eax, ebx, ecx, edx;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
}
#endif

/* 1 when this build has the table and the running CPU can execute it. */
static int
isa_supported(const cpu_kernels *k)
{
#if TM_CPU_X86
    __builtin_cpu_init();
    if (k == &cpu_kernels_avx512) {
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma") && has_f16c();
    }
    if (k == &cpu_kernels_avx2) {
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    }
#endif
    return k == &cpu_kernels_generic;
}

/* Every instruction set titanmac_c knows, best first; the table is NULL where this build has
 * none (AVX2 and AVX-512 off x86), so the name is still known and reported as unsupported. */
static const struct {
    const char *name;
    const cpu_kernels *kernels;
} cpu_all[] = {
#if TM_CPU_X86
    {"avx512", &cpu_kernels_avx512},
    {"avx2", &cpu_kernels_avx2},
#else
    {"avx512", NULL},
    {"avx2", NULL},
#endif
    {"generic", &cpu_kernels_generic},
};

#define CPU_NUM_ISAS ((int)(sizeof cpu_all / sizeof cpu_all[0]))

static const cpu_kernels *
best_supported(void)
{
    for (int i = 0; i < CPU_NUM_ISAS; i++) {
        if (cpu_all[i].kernels != NULL && isa_supported(cpu_all[i].kernels)) {
            return cpu_all[i].kernels;
        }
    }
    return &cpu_kernels_generic;
}

const cpu_kernels *
cpu_active_kernels(void)
{
    const cpu_kernels *k = atomic_load_explicit(&cpu_active, memory_order_acquire);
    if (k == NULL) {
        const cpu_kernels *expected = NULL;
        k = best_supported();
        /* A concurrent tm_cpu_select_isa wins over this default. */
        if (!atomic_compare_exchange_strong(&cpu_active, &expected, k)) {
            k = expected;
        }
    }
    return k;
}

tm_status
cpu_select_isa(const char *name)
{
    if (name == NULL || name[0] == '\0') {
        atomic_store_explicit(&cpu_active, best_supported(), memory_order_release);
        return TM_OK;
    }
    for (int i = 0; i < CPU_NUM_ISAS; i++) {
        if (strcmp(name, cpu_all[i].name) == 0) {
            const cpu_kernels *k = cpu_all[i].kernels;
            TM_CHECK(k != NULL && isa_supported(k), TM_ERR_VALUE,
                     "cpu isa \"%s\": not supported by this CPU or build", name);
            atomic_store_explicit(&cpu_active, k, memory_order_release);
            return TM_OK;
        }
    }
    return tm_set_error(TM_ERR_VALUE, __FILE__, __LINE__,
                        "cpu isa \"%s\": unknown; expected \"generic\", \"avx2\" or \"avx512\"",
                        name);
}
