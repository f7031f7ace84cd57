/*
 * tm_math.h -- the element math of every op, written once and compiled by both backends
 * (the CPU loops and the CUDA kernels include this file), so the two cannot drift.
 *
 * All element math is float32. Coefficients that depend on the step count are computed once per
 * tensor in double (as torch computes them in Python floats) and rounded to float once.
 * The order of operations follows torch.optim.AdamW's for-loop implementation
 * (torch/optim/adam.py, _single_tensor_adam with decoupled weight decay) so fp32 results agree
 * with torch to the last bits in most elements: p *= 1 - lr*wd; m.lerp_(g, 1-beta1);
 * v.mul_(beta2).addcmul_(g, g, 1-beta2); denom = sqrt(v)/bc2_sqrt + eps;
 * p.addcdiv_(m, denom, -step_size).
 * The CPU build compiles this in ISO C mode, where GCC does not contract a*b+c into an FMA, so
 * every instruction set gives the same bits. nvcc contracts by default; CUDA results therefore
 * differ from the CPU's in the last bit of some elements, and the CUDA tests use tolerances.
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

/* ---------------------------------------------------------------- AdamW ---- */

/* Everything one tensor's update needs besides its elements. */
typedef struct {
    float decay;           /* 1 - lr * weight_decay */
    float one_minus_beta1; /* lerp weight */
    float beta2;
    float one_minus_beta2;
    float bc2_sqrt;        /* sqrt(1 - beta2^step) */
    float neg_step_size;   /* -lr / (1 - beta1^step) */
    float eps;
    float grad_scale;      /* 1 unless a clip coefficient (or other scale) is folded in */
    int32_t maximize;
    int32_t amsgrad;
} tm_adamw_coeffs;

/* step is the count after this update (1 on the first step). */
TM_HOST_DEVICE tm_adamw_coeffs
tm_adamw_coeffs_make(double lr, double beta1, double beta2, double eps, double weight_decay,
                     double step, float grad_scale, int32_t maximize, int32_t amsgrad)
{
    tm_adamw_coeffs c;
    c.decay = (float)(1.0 - lr * weight_decay);
    c.one_minus_beta1 = (float)(1.0 - beta1);
    c.beta2 = (float)beta2;
    c.one_minus_beta2 = (float)(1.0 - beta2);
    c.bc2_sqrt = (float)sqrt(1.0 - pow(beta2, step));
    c.neg_step_size = (float)(-(lr / (1.0 - pow(beta1, step))));
    c.eps = (float)eps;
    c.grad_scale = grad_scale;
    c.maximize = maximize;
    c.amsgrad = amsgrad;
    return c;
}

/* torch.lerp: the two-sided form keeps the result exact at both ends. */
TM_HOST_DEVICE float
tm_lerp(float a, float b, float w)
{
    return (w < 0.5f) ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

/* torch.maximum propagates NaN from either side; fmaxf would drop it. */
TM_HOST_DEVICE float
tm_max_nan(float a, float b)
{
    return (a > b || a != a) ? a : b;
}

/* One element. vmax is read and written only when c->amsgrad. */
TM_HOST_DEVICE void
tm_adamw_elem(float *p, float *m, float *v, float *vmax, float g, const tm_adamw_coeffs *c)
{
    g = g * c->grad_scale;
    if (c->maximize) {
        g = -g;
    }
    float pv = *p * c->decay;
    float mv = tm_lerp(*m, g, c->one_minus_beta1);
    float vv = *v * c->beta2;
    vv = vv + c->one_minus_beta2 * g * g;
    float vden = vv;
    if (c->amsgrad) {
        vden = tm_max_nan(*vmax, vv);
        *vmax = vden;
    }
    float denom = sqrtf(vden) / c->bc2_sqrt + c->eps;
    *p = pv + c->neg_step_size * (mv / denom);
    *m = mv;
    *v = vv;
}

/* ---------------------------------------------------------------- clipping ---- */

/* torch's clip_grad_norm_: max_norm / (norm + 1e-6) is evaluated as reciprocal(norm + 1e-6) *
 * max_norm (Tensor.__rdiv__), then clamp(max=1), which keeps NaN. */
TM_HOST_DEVICE float
tm_clip_coef_elem(float total_norm, float max_norm)
{
    float recip = 1.0f / (total_norm + 1e-6f);
    float coef = recip * max_norm;
    return (coef > 1.0f) ? 1.0f : coef;
}

/* ---------------------------------------------------------------- norms ---- */

/* |x|^p accumulated in double; p == 2 and p == 1 are the common fast cases. */
TM_HOST_DEVICE double
tm_pow_abs(float x, double p)
{
    double a = fabs((double)x);
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
tm_max_abs_nan(double acc, float x)
{
    double a = fabs((double)x);
    return (a > acc || a != a) ? a : acc;
}

/* Turn a reduced value (sum |x|^p, or max |x| when p is infinite) into the norm. */
TM_HOST_DEVICE float
tm_norm_finish(double reduced, double p)
{
    if (isinf(p) || p == 1.0) {
        return (float)reduced;
    }
    if (p == 2.0) {
        return (float)sqrt(reduced);
    }
    return (float)pow(reduced, 1.0 / p);
}

#endif /* TM_MATH_H */
