/*
 * tm_cms_math.h -- the element math of the DeepNestedOptimizer's CMS update (tm_cms_step, spec
 * deep_nested_optimizer.md 7.2 Phase 2 and 7.3), written once for the CPU loops (cpu/cpu_cms*)
 * and the CUDA kernels (cuda/cms*.cu), so the two backends give the same bits; the math run once
 * per (tensor, level) is in tm_cms_finish.h.
 *
 * Per firing level l of a tensor (reference: _reference_dno.py _cms_update_param):
 *   g^   = (A_l + g) / div_l                    A_l = 0 afterwards; g is the clipped gradient
 *   e_l  = d_l e_l + (1 - d_l) g^               v_l = 0.999 v_l + 0.001 g^ g^
 *   DIRECT: delta = MLP(log_g, sign_g, log_m, sign_m)   m' = 0.9 m + 0.1 delta    c_l = delta
 *   LEGACY: (a, b, d) = MLP(stats(m), stats(g^), ctx)  m' = a m + b g^           c_l = m (1 - d)
 *   m_l  = m' * (||m'|| > r ? r / ||m'|| : 1),  r = 100 max(||g^||, 1e-8)
 * then u = sum of the finite c_l (n of them), u /= sqrt(n) when n > 1, u += wd p, p -= lr u.
 *
 * Every float operation is the one torch performs, in torch's order, each rounded once:
 * tm_fmul / tm_fadd / tm_fdiv never contract into an FMA (nvcc would; ISO C on the host does
 * not), and exp / log are our own branch-free polynomials (Cephes expf / logf, about 1 ulp), so
 * the CPU vectorizes them and CUDA computes the same bits. FMAs (tm_fma, correctly rounded on
 * both backends) only where we choose them: in our exp's polynomial, and p + (-lr) u, which
 * torch's add_ fuses too (on an x86-64 without FMA the generic loops call libm's fmaf there:
 * same bits, slower). torch's own exp / log / matmul round differently in
 * the last bit, hence the tolerances of tests/cms/test_cms_op.py. The Linear layers of the DIRECT
 * network sum in float in index order (acc = w0 x0; acc += wk xk; + bias) at the padded width
 * TM_CMS_DIRECT_MAX_HIDDEN (zero weights and biases past H: each padded term adds an exact +0),
 * one element per CUDA thread or per CPU SIMD lane. The LEGACY network runs once per (tensor,
 * level), with double sums (tm_dno_unit) and sigmoid / tanh in double rounded once.
 * Selects are tm_cms_select (plain ?:, if-converted on the host thanks to -fno-trapping-math).
 */
#ifndef TM_CMS_MATH_H
#define TM_CMS_MATH_H

#include <stdint.h>
#include <string.h>

#include "tm_math.h"
#include "titanmac.h" /* tm_cms_args and the CMS size limits */

#define TM_CMS_DIRECT_IN 4
#define TM_CMS_LEGACY_IN 9
#define TM_CMS_LEGACY_OUT 3
#define TM_CMS_DIRECT_PARTS 3 /* per (unit, level): sum g^2, sum m'^2, sum delta^2 */
#define TM_CMS_LEGACY_PARTS 7 /* shifted sums of m and g^ (3 each, see tm_cms_stats), sum m'^2 */

#if defined(__CUDA_ARCH__)
#define TM_CMS_UNROLL _Pragma("unroll")
#else
#define TM_CMS_UNROLL
#endif

/* ---------------------------------------------------------------- scalar ops ---- */

TM_HOST_DEVICE float
tm_fdiv(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

/* a * b + c with both roundings (no FMA): the order of torch's separate kernels. */
TM_HOST_DEVICE float
tm_fmuladd(float a, float b, float c)
{
    return tm_fadd(tm_fmul(a, b), c);
}

/* A true FMA: torch's add_(u, alpha=-lr) is one (vec::fmadd on the CPU, contracted on CUDA). */
TM_HOST_DEVICE float
tm_fma(float a, float b, float c)
{
#if defined(__CUDA_ARCH__)
    return __fmaf_rn(a, b, c);
#else
    return fmaf(a, b, c);
#endif
}

TM_HOST_DEVICE uint32_t
tm_cms_bits(float x)
{
#if defined(__CUDA_ARCH__)
    return __float_as_uint(x);
#else
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
#endif
}

TM_HOST_DEVICE float
tm_cms_float(uint32_t u)
{
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
#endif
}

/* cond ? a : b. The host build has -fno-trapping-math (setup.py), so GCC if-converts it into a
 * blend / min / max and the loops holding it vectorize; bit-mask selects did the same work in
 * four instructions each, a seventh of a CMS step. */
TM_HOST_DEVICE float
tm_cms_select(int cond, float a, float b)
{
    return cond ? a : b;
}

/* ---------------------------------------------------------------- exp, log, SiLU ---- */

/* 1 + e^-v, SiLU's denominator, the one use of an exponential here. e^x as Cephes expf:
 * n = round(x / ln 2) by the 1.5 * 2^23 trick, r = x - n ln 2 in two parts, a degree-6 polynomial
 * (Horner with FMAs: the CMS MLP's SiLU spends most of a CPU step here, and an FMA is one
 * instruction where a multiply and an add are two roundings and two), times 2^n. x is clamped to
 * [-86, ln FLT_MAX]: below -17, 1 + e^x rounds to 1 whatever e^x is, and above -86 the result is
 * normal (n >= -124), so 2^n is one scale, 2 * 2^(n - 1) (n <= 128), built from the bits of the
 * rounding trick's sum, whose low mantissa bits hold n: no int conversion, no guard for NaN (p
 * carries it). inf above ln FLT_MAX. Checked over all 2^32 inputs: bit for bit the sum that the
 * exact-to-subnormals version (two scales, NaN-guarded conversion) gave, for 8 fewer vector
 * operations of ~33; 60% of a CPU CMS step is here. */
TM_HOST_DEVICE float
tm_cms_silu_den(float v)
{
    const float x = -v;
    float c = tm_cms_select(x > 88.72283172607422f, 88.72283172607422f, x);
    c = tm_cms_select(c < -86.0f, -86.0f, c);
    const float t = tm_fadd(tm_fmul(c, 1.44269502162933349609375f), 12582912.0f);
    const float n = tm_fadd(t, -12582912.0f);
    const float r = tm_fadd(tm_fadd(c, tm_fmul(n, -0.693359375f)), tm_fmul(n, 2.12194440e-4f));
    float p = tm_fma(1.9875691500e-4f, r, 1.3981999507e-3f);
    p = tm_fma(p, r, 8.3334519073e-3f);
    p = tm_fma(p, r, 4.1665795894e-2f);
    p = tm_fma(p, r, 1.6666665459e-1f);
    p = tm_fma(p, r, 5.0000001201e-1f);
    p = tm_fadd(tm_fma(p, tm_fmul(r, r), r), 1.0f);
    /* bits(t) = bits(1.5 * 2^23) + n; the exponent field of 2^(n - 1) is n + 126 */
    const float half_scale = tm_cms_float((tm_cms_bits(t) - (0x4b400000u - 126u)) << 23);
    const float e = tm_cms_select(x > 88.72283172607422f, INFINITY,
                                  tm_fmul(tm_fmul(p, 2.0f), half_scale));
    return tm_fadd(1.0f, e);
}

/* ln x (Cephes logf) for x normal and > 0, or +inf. x = 2^e m with m in [sqrt(1/2), sqrt(2)),
 * f = m - 1 (exact), polynomial in f, plus e ln 2 in two parts. Other x: unspecified, never
 * used (preprocessing takes it only for |x| >= e^-10). */
TM_HOST_DEVICE float
tm_cms_log(float x)
{
    uint32_t u = tm_cms_bits(x);
    float m = tm_cms_float((u & 0x007fffffu) | 0x3f800000u);
    int32_t up = m > 1.41421356237f;
    m = tm_fmul(m, tm_cms_select(up, 0.5f, 1.0f)); /* exact */
    float e = (float)((int32_t)((u >> 23) & 0xffu) - 127 + up);
    float f = tm_fadd(m, -1.0f);
    float z = tm_fmul(f, f);
    float y = tm_fmuladd(7.0376836292e-2f, f, -1.1514610310e-1f);
    y = tm_fmuladd(y, f, 1.1676998740e-1f);
    y = tm_fmuladd(y, f, -1.2420140846e-1f);
    y = tm_fmuladd(y, f, 1.4249322787e-1f);
    y = tm_fmuladd(y, f, -1.6668057665e-1f);
    y = tm_fmuladd(y, f, 2.0000714765e-1f);
    y = tm_fmuladd(y, f, -2.4999993993e-1f);
    y = tm_fmuladd(y, f, 3.3333331174e-1f);
    y = tm_fmul(tm_fmul(y, f), z);
    y = tm_fadd(y, tm_fmul(e, -2.12194440e-4f));
    y = tm_fadd(y, tm_fmul(z, -0.5f));
    float r = tm_fadd(tm_fadd(f, y), tm_fmul(e, 0.693359375f));
    return tm_cms_select(x == INFINITY, x, r);
}

/* torch's SiLU: x / (1 + e^-x). */
TM_HOST_DEVICE float
tm_cms_silu(float x)
{
    return tm_fdiv(x, tm_cms_silu_den(x));
}

/* preprocess_gradient(x, p = 10): |x| >= e^-10 -> (ln|x| / 10, sign x), else (-1, e^10 x). The
 * threshold and e^10 are the float32 roundings of the Python floats (torch casts the scalar). */
TM_HOST_DEVICE void
tm_cms_preprocess(float x, float *log_feat, float *sign_feat)
{
    float a = fabsf(x);
    int big = a >= 0x1.7cd79cp-15f;
    float lg = tm_fdiv(tm_cms_log(a), 10.0f);
    float sg = tm_cms_select(x > 0.0f, 1.0f, -1.0f);
    float small = tm_fmul(0x1.5829dcp+14f, x);
    *log_feat = tm_cms_select(big, lg, -1.0f);
    *sign_feat = tm_cms_select(big, sg, small);
}

/* ---------------------------------------------------------------- DirectUpdateMLP ---- */

/* The network's weights, padded to the largest shape (rows of TM_CMS_DIRECT_MAX_HIDDEN), so the
 * per-element loops have compile-time strides. Lives in CUDA shared memory (12.3 KB), or on the
 * CPU driver's stack. */
typedef struct {
    float w_in[TM_CMS_DIRECT_MAX_HIDDEN][TM_CMS_DIRECT_IN];
    float b_in[TM_CMS_DIRECT_MAX_HIDDEN];
    float w_hid[TM_CMS_MAX_LAYERS - 1][TM_CMS_DIRECT_MAX_HIDDEN][TM_CMS_DIRECT_MAX_HIDDEN];
    float b_hid[TM_CMS_MAX_LAYERS - 1][TM_CMS_DIRECT_MAX_HIDDEN];
    float w_out[TM_CMS_DIRECT_MAX_HIDDEN];
    float b_out;
    int32_t hidden;
    int32_t layers;
} tm_cms_direct_net;

/* Entry i of a padded [rows, cols] block: w[r * h_cols + c] inside the real [h_rows, h_cols]
 * part, else 0. */
TM_HOST_DEVICE float
tm_cms_padded(const float *w, int32_t i, int32_t cols, int32_t h_rows, int32_t h_cols)
{
    const int32_t r = i / cols;
    const int32_t c = i % cols;
    return (r < h_rows && c < h_cols) ? w[r * h_cols + c] : 0.0f;
}

/* Writes entries first, first + step, ... of the padded net (so `step` threads with first =
 * 0..step-1 write all of it) from the module's weights w: W_in [H,4], b_in [H], (W [H,H],
 * b [H]) x (L-1), W_out [1,H], b_out [1]. */
TM_HOST_DEVICE void
tm_cms_direct_fill(tm_cms_direct_net *n, const float *const *w, int32_t h, int32_t layers,
                   int32_t first, int32_t step)
{
    const int32_t mh = TM_CMS_DIRECT_MAX_HIDDEN;
    for (int32_t i = first; i < mh * TM_CMS_DIRECT_IN; i += step) {
        n->w_in[i / TM_CMS_DIRECT_IN][i % TM_CMS_DIRECT_IN] =
            tm_cms_padded(w[0], i, TM_CMS_DIRECT_IN, h, TM_CMS_DIRECT_IN);
    }
    for (int32_t l = 0; l + 1 < layers; l++) {
        for (int32_t i = first; i < mh * mh; i += step) {
            n->w_hid[l][i / mh][i % mh] = tm_cms_padded(w[2 + 2 * l], i, mh, h, h);
        }
        for (int32_t i = first; i < mh; i += step) {
            n->b_hid[l][i] = tm_cms_padded(w[3 + 2 * l], i, mh, 1, h);
        }
    }
    for (int32_t i = first; i < mh; i += step) {
        n->b_in[i] = tm_cms_padded(w[1], i, mh, 1, h);
        n->w_out[i] = tm_cms_padded(w[2 * layers], i, mh, 1, h);
    }
    if (first == 0) {
        n->b_out = w[2 * layers + 1][0];
        n->hidden = h;
        n->layers = layers;
    }
}

/* One unit of n inputs: acc = w0 x0, acc += wk xk in index order, + bias. n is a constant at
 * every call (4, or the padded width), so the loop unrolls into straight-line code. */
TM_HOST_DEVICE float
tm_cms_unit(const float *w, const float *x, int32_t n, float bias)
{
    float acc = tm_fmul(w[0], x[0]);
    TM_CMS_UNROLL
    for (int32_t k = 1; k < n; k++) {
        acc = tm_fmuladd(w[k], x[k], acc);
    }
    return tm_fadd(acc, bias);
}

/* delta = MLP(preprocess(g^), preprocess(m)) for one element (CUDA threads, CPU tails; the CPU's
 * SIMD tiles do the same operations in the same order). Every layer runs at the padded width:
 * the padding's weights, biases and hence activations (SiLU(0) = +0) are zero, so each padded
 * term adds an exact +0. */
TM_HOST_DEVICE float
tm_cms_direct_delta(const tm_cms_direct_net *net, float g, float m)
{
    float x[TM_CMS_DIRECT_MAX_HIDDEN];
    float y[TM_CMS_DIRECT_MAX_HIDDEN];
    tm_cms_preprocess(g, &x[0], &x[1]);
    tm_cms_preprocess(m, &x[2], &x[3]);
    TM_CMS_UNROLL
    for (int32_t j = 0; j < TM_CMS_DIRECT_MAX_HIDDEN; j++) {
        y[j] = tm_cms_silu(tm_cms_unit(net->w_in[j], x, TM_CMS_DIRECT_IN, net->b_in[j]));
    }
    for (int32_t l = 0; l + 1 < net->layers; l++) {
        TM_CMS_UNROLL
        for (int32_t j = 0; j < TM_CMS_DIRECT_MAX_HIDDEN; j++) {
            x[j] = y[j];
        }
        TM_CMS_UNROLL
        for (int32_t j = 0; j < TM_CMS_DIRECT_MAX_HIDDEN; j++) {
            y[j] = tm_cms_silu(
                tm_cms_unit(net->w_hid[l][j], x, TM_CMS_DIRECT_MAX_HIDDEN, net->b_hid[l][j]));
        }
    }
    return tm_cms_unit(net->w_out, y, TM_CMS_DIRECT_MAX_HIDDEN, net->b_out);
}

/* ---------------------------------------------------------------- per-step constants ---- */

/* Host numbers rounded to float once, as torch rounds a Python float scalar into a float32 op. */
typedef struct {
    float div[TM_CMS_MAX_LEVELS];       /* max(cms_frequencies[l], 1) */
    float ema_keep[TM_CMS_MAX_LEVELS];  /* d_l */
    float ema_take[TM_CMS_MAX_LEVELS];  /* (float)(1 - d_l), the Python float difference */
    float beta2, beta2_take;            /* 0.999, (float)(1 - 0.999) */
    float mom_keep, mom_take;           /* 0.9, (float)(1 - 0.9) */
    float clamp_ratio;                  /* 100 */
    float weight_decay;
    double weight_decay_wide;           /* the Python float, for float64 parameters */
    int32_t levels;                     /* K */
    uint32_t fires;                     /* bit l: level l fires at this step */
} tm_cms_consts;

TM_HOST_DEVICE tm_cms_consts
tm_cms_consts_make(const tm_cms_args *a)
{
    tm_cms_consts c;
    c.fires = 0u;
    for (int32_t l = 0; l < TM_CMS_MAX_LEVELS; l++) {
        const int on = l < a->levels;
        c.div[l] = on ? (float)a->divisors[l] : 1.0f;
        c.ema_keep[l] = on ? (float)a->ema_decays[l] : 1.0f;
        c.ema_take[l] = on ? (float)(1.0 - a->ema_decays[l]) : 0.0f;
        c.fires |= (on && a->fires[l]) ? 1u << l : 0u;
    }
    c.beta2 = (float)a->beta2;
    c.beta2_take = (float)(1.0 - a->beta2);
    c.mom_keep = (float)a->momentum_coef;
    c.mom_take = (float)(1.0 - a->momentum_coef);
    c.clamp_ratio = (float)a->clamp_ratio;
    c.weight_decay = (float)a->weight_decay;
    c.weight_decay_wide = a->weight_decay;
    c.levels = a->levels;
    return c;
}

/* ---------------------------------------------------------------- float64 parameters ---- */

/* A float64 model's CMS step is the reference's: its buffers and update are float32 as for
 * every model, and only two operations see the float64 tensors. The accumulate adds the float64
 * gradient (clipped in double) into the float32 buffer: torch's add_ computes in double and
 * rounds once. The apply widens the float32 update exactly and steps p in double: p + (-lr)
 * (u + wd p), torch's add_ with alpha as one FMA, wd p rounded before its add. */
TM_HOST_DEVICE float
tm_cms_acc_add_wide(float acc, double g)
{
#if defined(__CUDA_ARCH__)
    return __double2float_rn(__dadd_rn((double)acc, g));
#else
    return (float)((double)acc + g);
#endif
}

TM_HOST_DEVICE double
tm_cms_apply_wide(double p, float v, double alpha, double wd, int decay)
{
#if defined(__CUDA_ARCH__)
    const double u = decay ? __dadd_rn((double)v, __dmul_rn(wd, p)) : (double)v;
    return __fma_rn(alpha, u, p);
#else
    const double u = decay ? (double)v + wd * p : (double)v;
    return fma(alpha, u, p);
#endif
}

/* The unconditional updates of a firing level: e and v (spec 7.2 steps 3.2, 3.3). */
TM_HOST_DEVICE float
tm_cms_ema_next(float e, float gh, const tm_cms_consts *c, int32_t l)
{
    return tm_fadd(tm_fmul(c->ema_keep[l], e), tm_fmul(c->ema_take[l], gh));
}

TM_HOST_DEVICE float
tm_cms_vsq_next(float v, float gh, const tm_cms_consts *c)
{
    return tm_fadd(tm_fmul(c->beta2, v), tm_fmul(c->beta2_take, tm_fmul(gh, gh)));
}

/* Both, in place; a NULL buffer is one the caller does not keep. */
TM_HOST_DEVICE void
tm_cms_ema_elem(float *e, float *v, float gh, const tm_cms_consts *c, int32_t l)
{
    if (e != NULL) {
        *e = tm_cms_ema_next(*e, gh, c, l);
    }
    if (v != NULL) {
        *v = tm_cms_vsq_next(*v, gh, c);
    }
}

#endif /* TM_CMS_MATH_H */
