/*
 * cpu_loops_impl.h -- the CPU loop bodies, written once and compiled once per instruction set:
 * cpu_generic.c, cpu_avx2.c and cpu_avx512.c define TM_ISA_SUFFIX and include this file under
 * their own -m flags, which gives the table cpu_kernels_<suffix> (ggml's per-ISA builds of one
 * source; PyTorch's DispatchStub).
 *
 * Element math comes only from tm_math.h (shared with CUDA) and tm_half.h. The loops are plain C
 * that GCC vectorizes (-O3 -fno-math-errno, checked with -fopt-info-vec); the dtype and the
 * amsgrad flag are compile-time constants of each specialised loop, so no branch stays inside.
 * Every ISA gives the same bits: element-wise ops are IEEE (ISO C mode does not contract a*b+c
 * into an FMA), and the reductions fix their association in the source (8 accumulators, each
 * taking every 8th element, combined pairwise) instead of leaving it to the vectorizer.
 */
#ifndef TM_ISA_SUFFIX
#error "define TM_ISA_SUFFIX before including cpu_loops_impl.h"
#endif

#include <float.h>
#include <math.h>
#include <stdint.h>

#include "../common/tm_half.h"
#include "../common/tm_math.h"
#include "cpu_ops.h"

#define TM_CAT_(a, b) a##b
#define TM_CAT(a, b) TM_CAT_(a, b)
#define TM_STR_(a) #a
#define TM_STR(a) TM_STR_(a)

/* Promise the vectorizer that the element accesses of one iteration are independent. clang gets
 * its own pragma with unrolling off: it fully unrolls a short loop (a CMS tile's 16 lanes) before
 * its loop vectorizer runs, `omp simd` or not, and left the unrolled SiLUs scalar (a CMS step
 * ~2x slower than GCC's build; 12x with the lanes in the element loop). */
#if defined(__clang__)
#define TM_SIMD _Pragma("clang loop vectorize(assume_safety) unroll(disable)")
#elif defined(_OPENMP)
#define TM_SIMD _Pragma("omp simd")
#elif defined(__GNUC__)
#define TM_SIMD _Pragma("GCC ivdep")
#else
#define TM_SIMD
#endif

/* The loops below are specialised by constant arguments (dtype, amsgrad, norm kind); they must
 * be inlined into their callers for those constants to fold away. */
#if defined(__GNUC__)
#define CPU_INLINE static inline __attribute__((always_inline))
#else
#define CPU_INLINE static inline
#endif

/* Accumulators per block reduction: enough independent add chains to hide the add latency, and
 * part of the result's definition (changing it changes the bits). */
#define CPU_ACC 8

/* Element i as a float (a float64 one rounded: the float32 view torch's .float() takes). */
CPU_INLINE float
load_elem(const void *x, int64_t i, tm_dtype dt)
{
    if (dt == TM_FLOAT32) {
        return ((const float *)x)[i];
    }
    if (dt == TM_FLOAT64) {
        return (float)((const double *)x)[i];
    }
    if (dt == TM_BFLOAT16) {
        return tm_bf16_to_f32(((const uint16_t *)x)[i]);
    }
    return tm_f16_to_f32(((const uint16_t *)x)[i]);
}

/* Element i as a double: a float64 one as it is, the others widened exactly from float. */
CPU_INLINE double
load_wide(const void *x, int64_t i, tm_dtype dt)
{
    return dt == TM_FLOAT64 ? ((const double *)x)[i] : (double)load_elem(x, i, dt);
}

CPU_INLINE void
store_elem(void *x, int64_t i, float value, tm_dtype dt)
{
    if (dt == TM_FLOAT32) {
        ((float *)x)[i] = value;
    } else if (dt == TM_BFLOAT16) {
        ((uint16_t *)x)[i] = tm_f32_to_bf16(value);
    } else {
        ((uint16_t *)x)[i] = tm_f32_to_f16(value);
    }
}

/* ---------------------------------------------------------------- AdamW ---- */

/* float32, float16 and bfloat16 tensors: float math, one rounding per store. */
CPU_INLINE void
adamw_loop(void *restrict p, void *restrict g, void *restrict m, void *restrict v,
           void *restrict vmax, int64_t n, tm_dtype dt, tm_adamw_coeffs c, int32_t amsgrad,
           int32_t unscale)
{
    c.amsgrad = amsgrad; /* a constant here, so the amsgrad branch of tm_adamw_elem folds away */
    TM_SIMD
    for (int64_t i = 0; i < n; i++) {
        float pv = load_elem(p, i, dt);
        float mv = load_elem(m, i, dt);
        float vv = load_elem(v, i, dt);
        float xv = amsgrad ? load_elem(vmax, i, dt) : 0.0f;
        const float gv = tm_adamw_scaled_grad(load_elem(g, i, dt), &c, unscale);
        tm_adamw_elem(&pv, &mv, &vv, &xv, gv, &c);
        store_elem(p, i, pv, dt);
        store_elem(m, i, mv, dt);
        store_elem(v, i, vv, dt);
        if (amsgrad) {
            store_elem(vmax, i, xv, dt);
        }
        if (unscale) {
            store_elem(g, i, gv, dt);
        }
    }
}

/* float64 tensors: double math, as torch updates them. */
CPU_INLINE void
adamw_loop_f64(double *restrict p, double *restrict g, double *restrict m, double *restrict v,
               double *restrict vmax, int64_t n, tm_adamw_coeffs_f64 c, int32_t amsgrad,
               int32_t unscale)
{
    c.amsgrad = amsgrad;
    TM_SIMD
    for (int64_t i = 0; i < n; i++) {
        double pv = p[i];
        double mv = m[i];
        double vv = v[i];
        double xv = amsgrad ? vmax[i] : 0.0;
        const double gv = tm_adamw_scaled_grad_f64(g[i], &c, unscale);
        tm_adamw_elem_f64(&pv, &mv, &vv, &xv, gv, &c);
        p[i] = pv;
        m[i] = mv;
        v[i] = vv;
        if (amsgrad) {
            vmax[i] = xv;
        }
        if (unscale) {
            g[i] = gv;
        }
    }
}

/* LOOP(args..., K, amsgrad, unscale) with amsgrad and unscale (divide by the loss scale, store
 * the gradient back) as constants, so none of the four loops has a test inside. And around
 * them the test tm_lerp makes: it picks its formula by w < 0.5, both arms do float math, which
 * GCC will not speculate (-ftrapping-math), so a test left in the loop is a branch that stops
 * vectorization; testing the same condition around the loop lets the compiler fold the one
 * inside. */
#define CPU_ADAMW_FLAGS(LOOP, K, UNSCALE, ...)                                                     \
    if ((K).amsgrad) {                                                                             \
        if (UNSCALE) {                                                                             \
            LOOP(__VA_ARGS__, K, 1, 1);                                                            \
        } else {                                                                                   \
            LOOP(__VA_ARGS__, K, 1, 0);                                                            \
        }                                                                                          \
    } else {                                                                                       \
        if (UNSCALE) {                                                                             \
            LOOP(__VA_ARGS__, K, 0, 1);                                                            \
        } else {                                                                                   \
            LOOP(__VA_ARGS__, K, 0, 0);                                                            \
        }                                                                                          \
    }
#define CPU_ADAMW_SPECIALISE(LOOP, K, UNSCALE, ...)                                                \
    do {                                                                                           \
        if ((K).one_minus_beta1 < 0.5f) {                                                          \
            CPU_ADAMW_FLAGS(LOOP, K, UNSCALE, __VA_ARGS__)                                         \
        } else {                                                                                   \
            CPU_ADAMW_FLAGS(LOOP, K, UNSCALE, __VA_ARGS__)                                         \
        }                                                                                          \
    } while (0)

/* coeffs: a tm_adamw_coeffs (tm_adamw_coeffs_f64 for adamw_f64). */
#define CPU_DEFINE_ADAMW(DT, DTYPE)                                                                \
    static void adamw_##DT(void *p, void *g, void *m, void *v, void *vmax, int64_t n,              \
                           const void *coeffs, int32_t unscale)                                    \
    {                                                                                              \
        const tm_adamw_coeffs k = *(const tm_adamw_coeffs *)coeffs;                                \
        CPU_ADAMW_SPECIALISE(adamw_loop, k, unscale, p, g, m, v, vmax, n, DTYPE);                  \
    }

static void
adamw_f64(void *p, void *g, void *m, void *v, void *vmax, int64_t n, const void *coeffs,
          int32_t unscale)
{
    const tm_adamw_coeffs_f64 k = *(const tm_adamw_coeffs_f64 *)coeffs;
    CPU_ADAMW_SPECIALISE(adamw_loop_f64, k, unscale, p, g, m, v, vmax, n);
}

/* ---------------------------------------------------------------- scale ---- */

/* A float64 tensor is multiplied in double; the others by the factor rounded to float (torch's
 * clip multiplies each gradient by the coefficient cast to its dtype). */
CPU_INLINE void
scale_loop(void *restrict x, int64_t n, double scale, tm_dtype dt)
{
    if (dt == TM_FLOAT64) {
        double *restrict xd = x;
        TM_SIMD
        for (int64_t i = 0; i < n; i++) {
            xd[i] *= scale;
        }
        return;
    }
    const float s = (float)scale;
    TM_SIMD
    for (int64_t i = 0; i < n; i++) {
        store_elem(x, i, load_elem(x, i, dt) * s, dt);
    }
}

#define CPU_DEFINE_SCALE(DT, DTYPE)                                                                \
    static void scale_##DT(void *x, int64_t n, double scale) { scale_loop(x, n, scale, DTYPE); }

/* ---------------------------------------------------------------- norms ---- */

CPU_INLINE double
reduce_add(double acc, double x, cpu_norm_kind kind, double p)
{
    switch (kind) {
    case CPU_NORM_L1:
        return acc + tm_pow_abs(x, 1.0);
    case CPU_NORM_L2:
        return acc + tm_pow_abs(x, 2.0);
    case CPU_NORM_LINF:
        return tm_max_abs_nan(acc, x);
    case CPU_NORM_LP:
        break;
    }
    return acc + tm_pow_abs(x, p);
}

CPU_INLINE double
reduce_join(double a, double b, cpu_norm_kind kind)
{
    return kind == CPU_NORM_LINF ? cpu_max_nan(a, b) : a + b;
}

/* Accumulator j takes elements j, j + 8, j + 16, ... of the block; then ((0+1)+(2+3)) +
 * ((4+5)+(6+7)). The unrolled j loop is what the vectorizer turns into 8 lanes (GCC keeps the
 * association: it vectorizes a float reduction only where each accumulator is one lane). */
CPU_INLINE double
reduce_loop(const void *restrict x, int64_t n, cpu_norm_kind kind, double p, tm_dtype dt)
{
    double acc[CPU_ACC] = {0.0};
    int64_t i = 0;
    for (; i + CPU_ACC <= n; i += CPU_ACC) {
#pragma GCC unroll 8
        for (int j = 0; j < CPU_ACC; j++) {
            acc[j] = reduce_add(acc[j], load_wide(x, i + j, dt), kind, p);
        }
    }
    for (int j = 0; i + j < n; j++) {
        acc[j] = reduce_add(acc[j], load_wide(x, i + j, dt), kind, p);
    }
    double lo =
        reduce_join(reduce_join(acc[0], acc[1], kind), reduce_join(acc[2], acc[3], kind), kind);
    double hi =
        reduce_join(reduce_join(acc[4], acc[5], kind), reduce_join(acc[6], acc[7], kind), kind);
    return reduce_join(lo, hi, kind);
}

/* The kind is turned into a constant per loop so each loop has one straight body. */
#define CPU_DEFINE_REDUCE(DT, DTYPE)                                                               \
    static double reduce_##DT(const void *x, int64_t n, cpu_norm_kind kind, double p)              \
    {                                                                                              \
        switch (kind) {                                                                            \
        case CPU_NORM_L1:                                                                          \
            return reduce_loop(x, n, CPU_NORM_L1, 1.0, DTYPE);                                     \
        case CPU_NORM_L2:                                                                          \
            return reduce_loop(x, n, CPU_NORM_L2, 2.0, DTYPE);                                     \
        case CPU_NORM_LINF:                                                                        \
            return reduce_loop(x, n, CPU_NORM_LINF, INFINITY, DTYPE);                              \
        case CPU_NORM_LP:                                                                          \
            break;                                                                                 \
        }                                                                                          \
        return reduce_loop(x, n, CPU_NORM_LP, p, DTYPE);                                           \
    }

/* For general p the reduced value can overflow to inf from finite data, so non-finite elements
 * are looked for separately; !(|x| <= FLT_MAX) is true for NaN and +-inf alike. (No TM_SIMD: an
 * integer OR reduction vectorizes as it is, and omp simd would need a reduction clause.) */
CPU_INLINE int
nonfinite_loop(const void *restrict x, int64_t n, tm_dtype dt)
{
    int any = 0;
    if (dt == TM_FLOAT64) {
        for (int64_t i = 0; i < n; i++) {
            any |= !(fabs(((const double *)x)[i]) <= DBL_MAX);
        }
        return any;
    }
    for (int64_t i = 0; i < n; i++) {
        any |= !(fabsf(load_elem(x, i, dt)) <= FLT_MAX);
    }
    return any;
}

#define CPU_DEFINE_NONFINITE(DT, DTYPE)                                                            \
    static int nonfinite_##DT(const void *x, int64_t n) { return nonfinite_loop(x, n, DTYPE); }

#define CPU_DEFINE_DTYPE(DT, DTYPE)                                                                \
    CPU_DEFINE_SCALE(DT, DTYPE)                                                                    \
    CPU_DEFINE_REDUCE(DT, DTYPE)                                                                   \
    CPU_DEFINE_NONFINITE(DT, DTYPE)

CPU_DEFINE_ADAMW(f32, TM_FLOAT32)
CPU_DEFINE_ADAMW(f16, TM_FLOAT16)
CPU_DEFINE_ADAMW(bf16, TM_BFLOAT16)
CPU_DEFINE_DTYPE(f32, TM_FLOAT32)
CPU_DEFINE_DTYPE(f16, TM_FLOAT16)
CPU_DEFINE_DTYPE(bf16, TM_BFLOAT16)
CPU_DEFINE_DTYPE(f64, TM_FLOAT64)

#include "cpu_cms_loops_impl.h"

/* Indexed by tm_dtype: TM_FLOAT32, TM_FLOAT16, TM_BFLOAT16, TM_FLOAT64. */
_Static_assert(TM_FLOAT32 == 0 && TM_FLOAT16 == 1 && TM_BFLOAT16 == 2 && TM_FLOAT64 == 3 &&
                   TM_DTYPE_COUNT == 4,
               "table order is tm_dtype");

const cpu_kernels TM_CAT(cpu_kernels_, TM_ISA_SUFFIX) = {
    .name = TM_STR(TM_ISA_SUFFIX),
    .cms = &TM_CAT(cpu_cms_kernels_, TM_ISA_SUFFIX),
    .adamw = {adamw_f32, adamw_f16, adamw_bf16, adamw_f64},
    .scale = {scale_f32, scale_f16, scale_bf16, scale_f64},
    .reduce = {reduce_f32, reduce_f16, reduce_bf16, reduce_f64},
    .nonfinite = {nonfinite_f32, nonfinite_f16, nonfinite_bf16, nonfinite_f64},
};
