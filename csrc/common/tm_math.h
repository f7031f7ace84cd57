/*
 * tm_math.h -- the element math of every op, written once and compiled by both backends
 * (the CPU loops and the CUDA kernels include this file), so the two cannot drift.
 *
 * Element math is float32 for float32, bfloat16 and float16 tensors and double for float64 ones
 * (the AdamW and clip math is written once for both: TM_DEFINE_ADAMW_MATH). Coefficients that
 * depend on the step count are computed once per tensor in double (as torch computes them in
 * Python floats) and rounded to the compute type once.
 * The order of operations follows torch.optim.AdamW's for-loop implementation
 * (torch/optim/adam.py, _single_tensor_adam with decoupled weight decay) so fp32 results agree
 * with torch to the last bits in most elements: p *= 1 - lr*wd; m.lerp_(g, 1-beta1);
 * v.mul_(beta2).addcmul_(g, g, 1-beta2); denom = sqrt(v)/bc2_sqrt + eps;
 * p.addcdiv_(m, denom, -step_size).
 * The CPU build compiles this in ISO C mode, where GCC does not contract a*b+c into an FMA, so
 * every instruction set gives the same bits. nvcc contracts by default; CUDA results therefore
 * differ from the CPU's in the last bit of some elements, and the CUDA tests use tolerances.
 *
 * The DeepNestedOptimizer's control step (tm_dno_*) is the exception: its scalar expressions use
 * tm_fmul / tm_fadd, which nvcc does not contract, and its Linear layers sum exact double
 * products, so both backends give the same bits (spec deep_nested_optimizer.md sections 3-5).
 */
#ifndef TM_MATH_H
#define TM_MATH_H

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define TM_HOST_DEVICE static inline __host__ __device__
#else
#define TM_HOST_DEVICE static inline
#endif

/* ---------------------------------------------------------------- AdamW, clipping ---- */

/* The element math of AdamW and of the clip coefficient, written once for the two compute types:
 * float (float32, bfloat16 and float16 tensors) and double (float64 tensors, which torch updates
 * in double with every coefficient the unrounded Python float). TM_DEFINE_ADAMW_MATH(REAL, SFX,
 * SQRT) defines tm_adamw_coeffs##SFX, tm_adamw_coeffs##SFX##_make, tm_lerp##SFX, tm_max_nan##SFX,
 * tm_adamw_scaled_grad##SFX, tm_adamw_elem##SFX and tm_clip_coef_elem##SFX; it is instantiated
 * below as the unsuffixed float names and the _f64 double names.
 *
 * tm_adamw_coeffs: everything one tensor's update needs besides its elements. step is the count
 * after this update (1 on the first step).
 *   decay = 1 - lr * weight_decay;  one_minus_beta1: the lerp weight;  bc2_sqrt = sqrt(1 -
 *   beta2^step);  neg_step_size = -lr / (1 - beta1^step);  grad_scale: 1 unless a clip
 *   coefficient (or other scale) is folded in;  loss_scale: torch.amp's loss scale, divided out
 *   where the caller asks.
 * tm_lerp: torch.lerp; the two-sided form keeps the result exact at both ends.
 * tm_max_nan: torch.maximum propagates NaN from either side; fmax would drop it.
 * tm_adamw_scaled_grad: the gradient as the update reads it: times grad_scale and, with unscale
 *   (a loss_scale given), divided by the loss scale as torch's fused AdamW divides (the value
 *   then stored back).
 * tm_adamw_elem: one element; g is tm_adamw_scaled_grad of the gradient. vmax is read and written
 *   only when c->amsgrad.
 * tm_clip_coef_elem: torch's clip_grad_norm_: max_norm / (norm + 1e-6) is evaluated as
 *   reciprocal(norm + 1e-6) * max_norm (Tensor.__rdiv__), then clamp(max=1), which keeps NaN. */
#define TM_DEFINE_ADAMW_MATH(REAL, SFX, SQRT)                                                      \
    typedef struct {                                                                               \
        REAL decay;                                                                                \
        REAL one_minus_beta1;                                                                      \
        REAL beta2;                                                                                \
        REAL one_minus_beta2;                                                                      \
        REAL bc2_sqrt;                                                                             \
        REAL neg_step_size;                                                                        \
        REAL eps;                                                                                  \
        REAL grad_scale;                                                                           \
        REAL loss_scale;                                                                           \
        int32_t maximize;                                                                          \
        int32_t amsgrad;                                                                           \
    } tm_adamw_coeffs##SFX;                                                                        \
                                                                                                   \
    TM_HOST_DEVICE tm_adamw_coeffs##SFX tm_adamw_coeffs##SFX##_make(                               \
        double lr, double beta1, double beta2, double eps, double weight_decay, double step,       \
        REAL grad_scale, int32_t maximize, int32_t amsgrad)                                        \
    {                                                                                              \
        tm_adamw_coeffs##SFX c;                                                                    \
        c.decay = (REAL)(1.0 - lr * weight_decay);                                                 \
        c.one_minus_beta1 = (REAL)(1.0 - beta1);                                                   \
        c.beta2 = (REAL)beta2;                                                                     \
        c.one_minus_beta2 = (REAL)(1.0 - beta2);                                                   \
        c.bc2_sqrt = (REAL)sqrt(1.0 - pow(beta2, step));                                           \
        c.neg_step_size = (REAL)(-(lr / (1.0 - pow(beta1, step))));                                \
        c.eps = (REAL)eps;                                                                         \
        c.grad_scale = grad_scale;                                                                 \
        c.loss_scale = (REAL)1.0;                                                                  \
        c.maximize = maximize;                                                                     \
        c.amsgrad = amsgrad;                                                                       \
        return c;                                                                                  \
    }                                                                                              \
                                                                                                   \
    TM_HOST_DEVICE REAL tm_lerp##SFX(REAL a, REAL b, REAL w)                                       \
    {                                                                                              \
        return (w < (REAL)0.5) ? a + w * (b - a) : b - (b - a) * ((REAL)1.0 - w);                  \
    }                                                                                              \
                                                                                                   \
    TM_HOST_DEVICE REAL tm_max_nan##SFX(REAL a, REAL b) { return (a > b || a != a) ? a : b; }      \
                                                                                                   \
    TM_HOST_DEVICE REAL tm_adamw_scaled_grad##SFX(REAL grad, const tm_adamw_coeffs##SFX *c,        \
                                                  int unscale)                                     \
    {                                                                                              \
        const REAL g = grad * c->grad_scale;                                                       \
        return unscale ? g / c->loss_scale : g;                                                    \
    }                                                                                              \
                                                                                                   \
    TM_HOST_DEVICE void tm_adamw_elem##SFX(REAL *p, REAL *m, REAL *v, REAL *vmax, REAL g,          \
                                           const tm_adamw_coeffs##SFX *c)                          \
    {                                                                                              \
        if (c->maximize) {                                                                         \
            g = -g;                                                                                \
        }                                                                                          \
        REAL pv = *p * c->decay;                                                                   \
        REAL mv = tm_lerp##SFX(*m, g, c->one_minus_beta1);                                         \
        REAL vv = *v * c->beta2;                                                                   \
        vv = vv + c->one_minus_beta2 * g * g;                                                      \
        REAL vden = vv;                                                                            \
        if (c->amsgrad) {                                                                          \
            vden = tm_max_nan##SFX(*vmax, vv);                                                     \
            *vmax = vden;                                                                          \
        }                                                                                          \
        REAL denom = SQRT(vden) / c->bc2_sqrt + c->eps;                                            \
        *p = pv + c->neg_step_size * (mv / denom);                                                 \
        *m = mv;                                                                                   \
        *v = vv;                                                                                   \
    }                                                                                              \
                                                                                                   \
    TM_HOST_DEVICE REAL tm_clip_coef_elem##SFX(REAL total_norm, REAL max_norm)                     \
    {                                                                                              \
        REAL recip = (REAL)1.0 / (total_norm + (REAL)1e-6);                                        \
        REAL coef = recip * max_norm;                                                              \
        return (coef > (REAL)1.0) ? (REAL)1.0 : coef;                                              \
    }

TM_DEFINE_ADAMW_MATH(float, , sqrtf)
TM_DEFINE_ADAMW_MATH(double, _f64, sqrt)

/* ------------------------------------------------------- float32-or-float64 scalars ---- */

/* Norms, clip coefficients, scale factors, learning rates and grad scales live in float32 or
 * float64 tensors (float64 where the tensors they serve are). Element i of one at data (f64: it
 * is float64) read as a double (exact), or written rounded once to its dtype. */
TM_HOST_DEVICE double
tm_real_load(const void *data, int f64, int64_t i)
{
    return f64 ? ((const double *)data)[i] : (double)((const float *)data)[i];
}

TM_HOST_DEVICE void
tm_real_store(void *data, int f64, int64_t i, double value)
{
    if (f64) {
        ((double *)data)[i] = value;
    } else {
        ((float *)data)[i] = (float)value;
    }
}

/* coef[0] = the clip coefficient of total_norm in the arithmetic of coef's dtype: float32 as torch
 * clips float32 gradients (the norm and max_norm rounded to float first), double for float64. */
TM_HOST_DEVICE void
tm_real_store_clip_coef(void *coef, int f64, double total_norm, double max_norm)
{
    if (f64) {
        *(double *)coef = tm_clip_coef_elem_f64(total_norm, max_norm);
    } else {
        *(float *)coef = tm_clip_coef_elem((float)total_norm, (float)max_norm);
    }
}

/* ---------------------------------------------------------------- norms ---- */

/* |x|^p accumulated in double; p == 2 and p == 1 are the common fast cases. The argument is
 * double so that a float64 element passes unrounded (a float widens exactly). */
TM_HOST_DEVICE double
tm_pow_abs(double x, double p)
{
    double a = fabs(x);
    if (p == 2.0) {
        return a * a;
    }
    if (p == 1.0) {
        return a;
    }
    return pow(a, p);
}

/* max |x| that propagates NaN, as torch's inf-norm does. */
TM_HOST_DEVICE double
tm_max_abs_nan(double acc, double x)
{
    double a = fabs(x);
    return (a > acc || a != a) ? a : acc;
}

/* Turn a reduced value (sum |x|^p, or max |x| when p is infinite) into the norm, in double: a
 * float32 output rounds it once when it is stored. */
TM_HOST_DEVICE double
tm_norm_finish(double reduced, double p)
{
    if (isinf(p) || p == 1.0) {
        return reduced;
    }
    if (p == 2.0) {
        return sqrt(reduced);
    }
    return pow(reduced, 1.0 / p);
}

/* ---------------------------------------------------------------- DeepNestedOptimizer ---- */

/* a * b and a + b rounded once each, never contracted into an FMA (nvcc contracts by default;
 * ISO C on the host does not): torch computes the DNO's scalar expressions one op at a time. */
TM_HOST_DEVICE float
tm_fmul(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

TM_HOST_DEVICE float
tm_fadd(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

/* The same in double: sums of products that both backends must round alike (nvcc contracts
 * a * b + c in double too). */
TM_HOST_DEVICE double
tm_dmul(double a, double b)
{
#if defined(__CUDA_ARCH__)
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}

TM_HOST_DEVICE double
tm_dadd(double a, double b)
{
#if defined(__CUDA_ARCH__)
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}

/* Host constants of one control step, each rounded to float once as torch rounds a Python float
 * scalar into a float32 op. */
typedef struct {
    float ema_keep;  /* (float)(1 - beta): the Python float 1.0 - 0.1 times a float32 tensor */
    double ema_beta; /* beta * loss is a Python float product, rounded by the tensor add */
    float mu_lo;     /* (float)mu_min */
    float mu_hi;     /* (float)mu_max */
    float mu_span;   /* (float)(mu_max - mu_min), the Python float difference */
    float max_norm;  /* (float)max_grad_norm */
} tm_dno_consts;

TM_HOST_DEVICE tm_dno_consts
tm_dno_consts_make(double ema_beta, double mu_min, double mu_max, double max_grad_norm)
{
    tm_dno_consts c;
    c.ema_keep = (float)(1.0 - ema_beta);
    c.ema_beta = ema_beta;
    c.mu_lo = (float)mu_min;
    c.mu_hi = (float)mu_max;
    c.mu_span = (float)(mu_max - mu_min);
    c.max_norm = (float)max_grad_norm;
    return c;
}

/* ema = (1 - beta) * ema + beta * L, as the reference's `0.9 * ema + 0.1 * loss` evaluates it:
 * a float32 multiply, the double product beta * L rounded to float, a float32 add. */
TM_HOST_DEVICE float
tm_dno_ema_elem(float ema, float loss, const tm_dno_consts *c)
{
    return tm_fadd(tm_fmul(ema, c->ema_keep), (float)(c->ema_beta * (double)loss));
}

/* Controller step 1 (spec 4): a non-finite input becomes 1.0. The stats of spec 3 already turned
 * non-finite norms into 1.0 and kept a non-finite depth, so this is the same for every column. */
TM_HOST_DEVICE float
tm_dno_clean(float x)
{
    return isfinite(x) ? x : 1.0f;
}

/* One output unit of a Linear layer, b + sum_k w[k] x[k], then ReLU when relu (torch.relu keeps
 * NaN). Products of floats are exact in double, so a double sum in one fixed order gives the same
 * bits on both backends whether or not it is contracted, and is rounded to float once. The order:
 * TM_DNO_LANES partial sums, lane k % TM_DNO_LANES taking the terms k, combined pairwise. One
 * running sum would be a chain of n dependent adds (a wide controller's 1,024-term units ran at
 * ~4 cycles a term on the CPU); lanes let the adds overlap, on the GPU's threads too. */
#define TM_DNO_LANES 8

TM_HOST_DEVICE float
tm_dno_unit(const float *w, float b, const float *x, int32_t n, int relu)
{
    double acc[TM_DNO_LANES] = {0.0};
    int32_t k = 0;
    for (; k + TM_DNO_LANES <= n; k += TM_DNO_LANES) {
        for (int32_t j = 0; j < TM_DNO_LANES; j++) {
            acc[j] += (double)w[k + j] * (double)x[k + j];
        }
    }
#ifdef __CUDA_ARCH__
    /* the same terms in the same lanes; a constant bound keeps acc in registers, where the run-
     * time bound below puts it in local memory */
    for (int32_t j = 0; j < TM_DNO_LANES; j++) {
        if (k + j < n) {
            acc[j] += (double)w[k + j] * (double)x[k + j];
        }
    }
#else
    for (int32_t j = 0; k + j < n; j++) { /* GCC: the guarded form above runs 1.8x slower */
        acc[j] += (double)w[k + j] * (double)x[k + j];
    }
#endif
    for (int32_t width = TM_DNO_LANES / 2; width > 0; width /= 2) {
        for (int32_t j = 0; j < width; j++) {
            acc[j] += acc[j + width];
        }
    }
    float y = (float)(acc[0] + (double)b);
    return (relu && y < 0.0f) ? 0.0f : y;
}

/* Controller steps 3 and 4: mu = clamp(mu_min + (mu_max - mu_min) * sigmoid(r), mu_min, mu_max),
 * a non-finite mu -> 1.0. sigmoid in double, rounded once (torch's float sigmoid is within an
 * ulp or two of that); the affine map and clamp in float32 as torch's scalar ops. */
TM_HOST_DEVICE float
tm_dno_mu_elem(float r, const tm_dno_consts *c)
{
    float s = (float)(1.0 / (1.0 + exp(-(double)r)));
    float mu = tm_fadd(c->mu_lo, tm_fmul(c->mu_span, s));
    mu = (mu < c->mu_lo) ? c->mu_lo : mu; /* NaN passes both, as in torch.clamp */
    mu = (mu > c->mu_hi) ? c->mu_hi : mu;
    return isfinite(mu) ? mu : 1.0f;
}

/* lr = base_lr * mu: the reference writes the Python float product into the AdamW group, so it
 * is formed in double and rounded to the float32 lr tensor once. */
TM_HOST_DEVICE float
tm_dno_lr_elem(double base_lr, float mu)
{
    return (float)(base_lr * (double)mu);
}

#endif /* TM_MATH_H */
