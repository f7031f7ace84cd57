/*
 * tm_cms_finish.h -- the per-(tensor, level) math of the CMS update (tm_cms_step, spec
 * deep_nested_optimizer.md 7.2 steps 3.4-3.7 and 4, 7.3), shared by cpu/cpu_cms.c and
 * cuda/cms_finish.cu: from a level's sums over the whole tensor, the clamp of _clamp_momentum,
 * the non-finite-contribution test, the sqrt(n) normalisation, and the L2RegressionMomentum
 * network (its stats input, its layers with double sums, its (a, b, 1 - d) mapping). The element
 * math is tm_cms_math.h's.
 */
#ifndef TM_CMS_FINISH_H
#define TM_CMS_FINISH_H

#include <float.h>

#include "tm_cms_math.h"

/* ---------------------------------------------------------------- per (tensor, level) ---- */

/* Results of the finalize step, read by the apply pass. */
typedef struct {
    float a, b, omd; /* LEGACY: m' = a m + b g^, contribution m (1 - d); unused by DIRECT */
    float scale;     /* 1, or r / ||m'|| when the clamp acts */
    int32_t ok;      /* fired, and every element of the contribution is finite */
    int32_t fired;
} tm_cms_level_out;

typedef struct {
    float sqrt_n; /* (float)sqrt(n_ok) */
    int32_t n_ok; /* finite contributions */
    int32_t apply; /* p changes: n_ok > 0 and u cannot overflow (see tm_cms_finish_tensor) */
    int32_t pad_;
} tm_cms_tensor_out;

/* _clamp_momentum: limit = 100 * max(||g^||, 1e-8) and ||m'|| in float32 (torch's norms are
 * float32; ours are double sums rounded once), NaN never clamps. */
TM_HOST_DEVICE float
tm_cms_clamp_scale(double gsq, double msq, float ratio)
{
    float gn = (float)sqrt(gsq);
    float mn = (float)sqrt(msq);
    float limit = tm_fmul(ratio, gn < 0x1.5798eep-27f ? 0x1.5798eep-27f : gn);
    return mn > limit ? tm_fdiv(limit, mn) : 1.0f;
}

/* One firing level from its combined sums (parts as in the TM_CMS_*_PARTS comments). ok: the
 * reference's isnan/isinf test of the contribution. A float squared cannot overflow a double sum,
 * so a sum is finite exactly when its elements are: DIRECT c = delta; LEGACY c = (m' s)(1 - d),
 * finite when m' is (0 <= s <= 1) and 1 - d is (or the tensor is empty). Returns an upper bound
 * of max |c| (its L2 norm) for the overflow test, 0 when not ok. */
TM_HOST_DEVICE double
tm_cms_finish_level(tm_cms_level_out *o, const double *parts, int legacy, int64_t numel,
                    float ratio)
{
    const double gsq = legacy ? parts[5] : parts[0];
    const double msq = legacy ? parts[6] : parts[1];
    o->scale = tm_cms_clamp_scale(gsq, msq, ratio);
    o->fired = 1;
    if (legacy) {
        o->ok = isfinite(msq) && (numel == 0 || isfinite(o->omd));
        return o->ok ? sqrt(msq) * o->scale * o->omd : 0.0;
    }
    o->ok = isfinite(parts[2]);
    return o->ok ? sqrt(parts[2]) : 0.0;
}

/* u = (sum of ok c_l) / sqrt(n) is finite in every element when the bounds of its terms sum
 * below FLT_MAX / 2 (then no float partial sum can round to inf). Above that the tensor is
 * skipped as the reference skips a non-finite u: the one place where we may skip and it not
 * (contributions of norm ~1.7e38; documented in titanmac.h). */
TM_HOST_DEVICE void
tm_cms_finish_tensor(tm_cms_tensor_out *o, int32_t n_ok, double bound)
{
    o->n_ok = n_ok;
    o->sqrt_n = (float)sqrt((double)n_ok);
    o->apply = n_ok > 0 && bound < 0.5 * (double)FLT_MAX;
    o->pad_ = 0;
}

/* ---------------------------------------------------------------- L2RegressionMomentum ---- */

/* stats(x) = [mean, unbiased std (0 when numel <= 1), L2 norm] from s = [sum (x - k),
 * sum (x - k)^2, sum x^2] with k = x[0] (a shift that keeps the variance free of cancellation
 * when |mean| >> std). numel 0: mean NaN, as torch's mean of an empty tensor. */
TM_HOST_DEVICE void
tm_cms_stats(const double *s, double shift, int64_t numel, float *out)
{
    const double n = (double)numel;
    double var = numel > 1 ? (s[1] - s[0] * s[0] / n) / (n - 1.0) : 0.0;
    var = var < 0.0 ? 0.0 : var;
    out[0] = numel > 0 ? (float)(shift + s[0] / n) : NAN;
    out[1] = (float)sqrt(var);
    out[2] = (float)sqrt(s[2]);
}

TM_HOST_DEVICE float
tm_cms_sigmoid(float x)
{
    return (float)(1.0 / (1.0 + exp(-(double)x)));
}

/* (a, b, 1 - d) for one (tensor, level): x = [stats(m), stats(g^), context] (9), the network
 * Linear(9,H), SiLU, ..., Linear(H,3) with w = the module's parameters (w[0] is residual_weight,
 * never used in forward); act holds 2 * hidden floats. a = 0.5 + 0.49 sigmoid(o0), b = tanh(o1),
 * d = sigmoid(o2), each rounded as torch's float32 scalar ops. */
TM_HOST_DEVICE void
tm_cms_legacy_coeffs(tm_cms_level_out *o, const float *const *w, int32_t h, int32_t layers,
                     const float *x, float *act)
{
    float *cur = act;
    float *nxt = act + h;
    for (int32_t j = 0; j < h; j++) {
        cur[j] = tm_cms_silu(tm_dno_unit(w[1] + (int64_t)j * TM_CMS_LEGACY_IN, w[2][j], x,
                                         TM_CMS_LEGACY_IN, 0));
    }
    for (int32_t l = 1; l < layers; l++) {
        for (int32_t j = 0; j < h; j++) {
            nxt[j] = tm_cms_silu(tm_dno_unit(w[1 + 2 * l] + (int64_t)j * h, w[2 + 2 * l][j], cur,
                                             h, 0));
        }
        float *t = cur;
        cur = nxt;
        nxt = t;
    }
    float out[TM_CMS_LEGACY_OUT];
    for (int32_t j = 0; j < TM_CMS_LEGACY_OUT; j++) {
        out[j] = tm_dno_unit(w[1 + 2 * layers] + (int64_t)j * h, w[2 + 2 * layers][j], cur, h, 0);
    }
    o->a = tm_fadd(0.5f, tm_fmul(0x1.f5c29p-2f, tm_cms_sigmoid(out[0])));
    o->b = (float)tanh((double)out[1]);
    o->omd = tm_fadd(1.0f, -tm_cms_sigmoid(out[2]));
}

/* The legacy context c = [t / 1000, base_lr, ln(max(L, 1e-8) + 1)] (Python floats rounded to
 * float32 by torch.tensor); max keeps a NaN loss as Python's max does. */
TM_HOST_DEVICE void
tm_cms_context(float *c, double t, double base_lr, float loss)
{
    double l = (double)loss;
    l = 1e-8 > l ? 1e-8 : l;
    c[0] = (float)(t / 1000.0);
    c[1] = (float)base_lr;
    c[2] = (float)log(l + 1.0);
}

/* Partial sums kept per (unit, level): units are the backend's reduction blocks. */
TM_HOST_DEVICE int32_t
tm_cms_parts_of(tm_cms_net net)
{
    return net == TM_CMS_LEGACY ? TM_CMS_LEGACY_PARTS : TM_CMS_DIRECT_PARTS;
}

/* The scratch layout both backends share: double partials [units][levels][parts], then the
 * per-(tensor, level) results [n][levels], then the per-tensor results [n]. */
TM_HOST_DEVICE size_t
tm_cms_scratch_layout_bytes(size_t units, size_t n, int32_t levels, tm_cms_net net)
{
    const size_t k = levels < 0 ? 0 : (levels > TM_CMS_MAX_LEVELS ? TM_CMS_MAX_LEVELS : levels);
    return units * k * (size_t)tm_cms_parts_of(net) * sizeof(double) +
           n * k * sizeof(tm_cms_level_out) + n * sizeof(tm_cms_tensor_out);
}

#endif /* TM_CMS_FINISH_H */
