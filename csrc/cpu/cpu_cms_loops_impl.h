/*
 * cpu_cms_loops_impl.h -- the CMS update's loops over one block (tm_cms_step; spec
 * deep_nested_optimizer.md 7.2), compiled once per instruction set: cpu_loops_impl.h includes it
 * after its load/store helpers, and its table points at cpu_cms_kernels_<isa>. cpu_cms.c drives
 * the passes and holds the formulas' overview; the element math is tm_cms_math.h's; the
 * DirectUpdateMLP on tiles of elements is cpu_cms_tile_impl.h's.
 *
 * Partial sums follow the block-reduction scheme of cpu_loops_impl.h:
 * element e of a block goes to accumulator e % 8, combined pairwise.
 */

#define CMS_TILE 64

_Static_assert(CMS_TILE % CPU_ACC == 0 && TM_CPU_BLOCK % CMS_TILE == 0, "tiles keep e % 8");

/* x rounded to dt and widened back (the identity for float32). */
CPU_INLINE float
cms_round(float x, tm_dtype dt)
{
    if (dt == TM_BFLOAT16) {
        return tm_bf16_to_f32(tm_f32_to_bf16(x));
    }
    return dt == TM_FLOAT16 ? tm_f16_to_f32(tm_f32_to_f16(x)) : x;
}

/* The clipped gradient as the reference holds it: g * scale rounded to the grad's dtype. */
CPU_INLINE float
cms_grad(const cpu_cms_block *b, int64_t i, tm_dtype dt)
{
    return cms_round(load_elem(b->g, i, dt) * b->grad_scale, dt);
}

/* A + g, the accumulator plus the clipped gradient as the reference's add_ rounds it into the
 * float32 buffer (a float64 gradient: clipped and added in double, rounded once). */
CPU_INLINE float
cms_acc_grad(const cpu_cms_block *b, float acc, int64_t i, tm_dtype dt)
{
    if (dt == TM_FLOAT64) {
        return tm_cms_acc_add_wide(acc, ((const double *)b->g)[i] * (double)b->grad_scale);
    }
    return tm_fadd(acc, cms_grad(b, i, dt));
}

/* g^ of element i at level l: (A_l + g) / div_l, the accumulate, then the clone's division. */
CPU_INLINE float
cms_level_grad(const cpu_cms_block *b, int l, int64_t i, tm_dtype dt)
{
    return tm_fdiv(cms_acc_grad(b, b->acc[l][i], i, dt), b->c->div[l]);
}

CPU_INLINE double
cms_join(const double *acc)
{
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* acc[j] += x[i + j]^2 over a tile (n a multiple of 8), in double. */
CPU_INLINE void
cms_sumsq(double *restrict acc, const float *restrict x, int64_t n)
{
    for (int64_t i = 0; i < n; i += CPU_ACC) {
#pragma GCC unroll 8
        for (int j = 0; j < CPU_ACC; j++) {
            acc[j] += (double)x[i + j] * (double)x[i + j];
        }
    }
}

/* Element i's e and v updates of level l, into the buffers the caller keeps (NULL: not kept). */
CPU_INLINE void
cms_ema_elem(const cpu_cms_block *b, int l, int64_t i, float gh)
{
    tm_cms_ema_elem(b->ema[l] != NULL ? &b->ema[l][i] : NULL,
                    b->vsq[l] != NULL ? &b->vsq[l][i] : NULL, gh, b->c, l);
}

/* ---------------------------------------------------------------- DIRECT tiles ---- */

#include "cpu_cms_tile_impl.h"

/* g^, m and the four features of elements [s, s + CMS_TILE); the e and v updates of the
 * buffers the caller keeps (NULL: not kept). */
CPU_INLINE void
cms_tile_inputs(const cpu_cms_block *b, int l, int64_t s, tm_dtype dt, cms_tile *t)
{
    const float *restrict acc = b->acc[l] + s;
    const float *restrict m = b->m[l] + s;
    const float div = b->c->div[l];
    TM_SIMD
    for (int e = 0; e < CMS_TILE; e++) {
        const float gh = tm_fdiv(cms_acc_grad(b, acc[e], s + e, dt), div);
        t->gh[e] = gh;
        t->m[e] = m[e];
        tm_cms_preprocess(gh, &t->act[0][0][e], &t->act[0][1][e]);
        tm_cms_preprocess(m[e], &t->act[0][2][e], &t->act[0][3][e]);
    }
    if (b->ema[l] != NULL) {
        float *restrict ema = b->ema[l] + s;
        TM_SIMD
        for (int e = 0; e < CMS_TILE; e++) {
            ema[e] = tm_cms_ema_next(ema[e], t->gh[e], b->c, l);
        }
    }
    if (b->vsq[l] != NULL) {
        float *restrict vsq = b->vsq[l] + s;
        TM_SIMD
        for (int e = 0; e < CMS_TILE; e++) {
            vsq[e] = tm_cms_vsq_next(vsq[e], t->gh[e], b->c);
        }
    }
}

/* m' = 0.9 m + 0.1 delta into m_l, delta into A_l until the apply pass; sums of squares. */
CPU_INLINE void
cms_tile_outputs(const cpu_cms_block *b, int l, int64_t s, cms_tile *t, double (*sums)[CPU_ACC])
{
    float *restrict acc = b->acc[l] + s;
    float *restrict m = b->m[l] + s;
    float mp[CMS_TILE];
    TM_SIMD
    for (int e = 0; e < CMS_TILE; e++) {
        mp[e] = tm_fadd(tm_fmul(b->c->mom_keep, t->m[e]), tm_fmul(b->c->mom_take, t->out[e]));
        m[e] = mp[e];
        acc[e] = t->out[e];
    }
    cms_sumsq(sums[0], t->gh, CMS_TILE);
    cms_sumsq(sums[1], mp, CMS_TILE);
    cms_sumsq(sums[2], t->out, CMS_TILE);
}

/* One firing level of a block: tiles, then the tail element by element. */
CPU_INLINE void
cms_direct_level(const cpu_cms_block *b, int l, tm_dtype dt, double (*sums)[CPU_ACC])
{
    cms_tile t;
    const int64_t full = b->n - b->n % CMS_TILE;
    for (int64_t s = 0; s < full; s += CMS_TILE) {
        cms_tile_inputs(b, l, s, dt, &t);
        cms_tile_mlp(b->net, &t);
        cms_tile_outputs(b, l, s, &t, sums);
    }
    for (int64_t i = full; i < b->n; i++) {
        const float gh = cms_level_grad(b, l, i, dt);
        cms_ema_elem(b, l, i, gh);
        const float d = tm_cms_direct_delta(b->net, gh, b->m[l][i]);
        const float mp = tm_fadd(tm_fmul(b->c->mom_keep, b->m[l][i]), tm_fmul(b->c->mom_take, d));
        b->m[l][i] = mp;
        b->acc[l][i] = d;
        sums[0][i % CPU_ACC] += (double)gh * (double)gh;
        sums[1][i % CPU_ACC] += (double)mp * (double)mp;
        sums[2][i % CPU_ACC] += (double)d * (double)d;
    }
}

/* ---------------------------------------------------------------- LEGACY ---- */

/* Element i of a firing level: m' = a m + b g^ into m_l, A_l = 0 (a LEGACY contribution needs
 * no delta), e and v; returns m'. */
CPU_INLINE float
cms_legacy_elem(const cpu_cms_block *b, int l, int64_t i, float ca, float cb, tm_dtype dt)
{
    const float gh = cms_level_grad(b, l, i, dt);
    cms_ema_elem(b, l, i, gh);
    const float mp = tm_fadd(tm_fmul(ca, b->m[l][i]), tm_fmul(cb, gh));
    b->m[l][i] = mp;
    b->acc[l][i] = 0.0f;
    return mp;
}

/* Pass A of a LEGACY firing level over a block; sums[e % 8] += m'^2. */
CPU_INLINE void
cms_legacy_level(const cpu_cms_block *b, int l, tm_dtype dt, double *restrict sums)
{
    const float ca = b->lv[l].a;
    const float cb = b->lv[l].b;
    const int64_t full = b->n - b->n % CPU_ACC;
    for (int64_t i = 0; i < full; i += CPU_ACC) {
#pragma GCC unroll 8
        for (int j = 0; j < CPU_ACC; j++) {
            const float mp = cms_legacy_elem(b, l, i + j, ca, cb, dt);
            sums[j] += (double)mp * (double)mp;
        }
    }
    for (int64_t i = full; i < b->n; i++) {
        const float mp = cms_legacy_elem(b, l, i, ca, cb, dt);
        sums[i % CPU_ACC] += (double)mp * (double)mp;
    }
}

/* s[q][j] += the q-th statistic term of element i (see cms_stats_level). */
CPU_INLINE void
cms_stats_elem(const cpu_cms_block *b, int l, int64_t i, int j, tm_dtype dt, double (*s)[CPU_ACC])
{
    const double km = b->shift_m[l];
    const double kg = b->shift_g[l];
    const double x = b->m[l][i];
    const double g = cms_level_grad(b, l, i, dt);
    s[0][j] += x - km;
    s[1][j] += (x - km) * (x - km);
    s[2][j] += x * x;
    s[3][j] += g - kg;
    s[4][j] += (g - kg) * (g - kg);
    s[5][j] += g * g;
}

/* Pass S: s = [sum (x - k), sum (x - k)^2, sum x^2] of m (k = m[0]) and of g^ (k = g^[0]). */
CPU_INLINE void
cms_stats_level(const cpu_cms_block *b, int l, tm_dtype dt, double (*s)[CPU_ACC])
{
    const int64_t full = b->n - b->n % CPU_ACC;
    for (int64_t i = 0; i < full; i += CPU_ACC) {
#pragma GCC unroll 8
        for (int j = 0; j < CPU_ACC; j++) {
            cms_stats_elem(b, l, i + j, j, dt, s);
        }
    }
    for (int64_t i = full; i < b->n; i++) {
        cms_stats_elem(b, l, i, (int)(i % CPU_ACC), dt, s);
    }
}

/* ---------------------------------------------------------------- passes ---- */

/* Pass A over a block: every non-firing level accumulates, every firing level updates. */
CPU_INLINE void
cms_update(const cpu_cms_block *b, tm_dtype dt)
{
    const int parts = b->legacy ? TM_CMS_LEGACY_PARTS : TM_CMS_DIRECT_PARTS;
    for (int l = 0; l < b->c->levels; l++) {
        if (!(b->c->fires >> l & 1u)) {
            float *restrict acc = b->acc[l];
            TM_SIMD
            for (int64_t i = 0; i < b->n; i++) {
                acc[i] = cms_acc_grad(b, acc[i], i, dt);
            }
            continue;
        }
        double sums[TM_CMS_DIRECT_PARTS][CPU_ACC] = {{0.0}};
        if (b->legacy) {
            cms_legacy_level(b, l, dt, sums[0]);
            b->parts[l * parts + TM_CMS_LEGACY_PARTS - 1] = cms_join(sums[0]);
        } else {
            cms_direct_level(b, l, dt, sums);
            for (int q = 0; q < TM_CMS_DIRECT_PARTS; q++) {
                b->parts[l * parts + q] = cms_join(sums[q]);
            }
        }
    }
}

CPU_INLINE void
cms_stats(const cpu_cms_block *b, tm_dtype dt)
{
    for (int l = 0; l < b->c->levels; l++) {
        if (b->c->fires >> l & 1u) {
            double s[TM_CMS_LEGACY_PARTS - 1][CPU_ACC] = {{0.0}};
            cms_stats_level(b, l, dt, s);
            for (int q = 0; q < TM_CMS_LEGACY_PARTS - 1; q++) {
                b->parts[l * TM_CMS_LEGACY_PARTS + q] = cms_join(s[q]);
            }
        }
    }
}

/* Pass B for one fired level: m_l = m' * scale; c = delta (DIRECT, held in A_l, which becomes
 * 0) or m_l (1 - d) (LEGACY); u += c when the level is ok. */
CPU_INLINE void
cms_apply_level(const cpu_cms_block *b, int l, float *restrict u, int direct)
{
    const tm_cms_level_out *o = &b->lv[l];
    float *restrict m = b->m[l];
    float *restrict acc = b->acc[l];
    const float scale = o->scale;
    const float omd = o->omd;
    const int ok = o->ok;
    TM_SIMD
    for (int64_t i = 0; i < b->n; i++) {
        const float mc = tm_fmul(m[i], scale);
        const float c = direct ? acc[i] : tm_fmul(mc, omd);
        m[i] = mc;
        if (direct) {
            acc[i] = 0.0f;
        }
        u[i] = tm_fadd(u[i], tm_cms_select(ok, c, 0.0f)); /* u + 0 == u: u starts at +0 */
    }
}

/* The last step of pass B: v = u / sqrt(n) (n > 1; else / 1, exact), + wd p (when wd > 0),
 * rounded to p's dtype, then p + (-lr) v as one FMA: torch's add_ with alpha (on the CPU torch
 * rounds alpha to p's dtype, a no-op for float32). */
CPU_INLINE void
cms_apply_params(const cpu_cms_block *b, const float *restrict u, tm_dtype dt, int decay)
{
    const float den = b->tv->n_ok > 1 ? b->tv->sqrt_n : 1.0f;
    if (dt == TM_FLOAT64) { /* in double, the float32 rate widened (tm_cms_apply_wide) */
        double *restrict p = b->p;
        const double alpha = -(double)b->lr;
        const double wd = b->c->weight_decay_wide;
        TM_SIMD
        for (int64_t i = 0; i < b->n; i++) {
            p[i] = tm_cms_apply_wide(p[i], tm_fdiv(u[i], den), alpha, wd, decay);
        }
        return;
    }
    const float alpha = cms_round(-b->lr, dt);
    const float wd = b->c->weight_decay;
    TM_SIMD
    for (int64_t i = 0; i < b->n; i++) {
        const float p = load_elem(b->p, i, dt);
        float v = tm_fdiv(u[i], den);
        if (decay) {
            v = tm_fadd(v, cms_round(tm_fmul(wd, p), dt));
        }
        store_elem(b->p, i, tm_fma(alpha, cms_round(v, dt), p), dt);
    }
}

/* Pass B: u = sum of the ok contributions (level order, from 0), then the params. */
CPU_INLINE void
cms_apply(const cpu_cms_block *b, tm_dtype dt)
{
    float u[TM_CPU_BLOCK];
    for (int64_t i = 0; i < b->n; i++) {
        u[i] = 0.0f;
    }
    for (int l = 0; l < b->c->levels; l++) {
        if (b->lv[l].fired && b->legacy) {
            cms_apply_level(b, l, u, 0);
        } else if (b->lv[l].fired) {
            cms_apply_level(b, l, u, 1);
        }
    }
    if (b->tv->apply && b->c->weight_decay > 0.0f) {
        cms_apply_params(b, u, dt, 1);
    } else if (b->tv->apply) {
        cms_apply_params(b, u, dt, 0);
    }
}

/* NAME_any(b) = NAME(b, b->dtype), through one specialisation per dtype (a constant dtype folds
 * the loads' conversions away inside each). */
#define CPU_DEFINE_BY_DTYPE(NAME, BLOCK)                                                           \
    static void NAME##_f32(const BLOCK *b) { NAME(b, TM_FLOAT32); }                                \
    static void NAME##_f16(const BLOCK *b) { NAME(b, TM_FLOAT16); }                                \
    static void NAME##_bf16(const BLOCK *b) { NAME(b, TM_BFLOAT16); }                              \
    static void NAME##_f64(const BLOCK *b) { NAME(b, TM_FLOAT64); }                                \
    static void NAME##_any(const BLOCK *b)                                                         \
    {                                                                                              \
        b->dtype == TM_FLOAT32   ? NAME##_f32(b)                                                   \
        : b->dtype == TM_FLOAT16 ? NAME##_f16(b)                                                   \
        : b->dtype == TM_FLOAT64 ? NAME##_f64(b)                                                   \
                                 : NAME##_bf16(b);                                                 \
    }

CPU_DEFINE_BY_DTYPE(cms_update, cpu_cms_block)
CPU_DEFINE_BY_DTYPE(cms_stats, cpu_cms_block)
CPU_DEFINE_BY_DTYPE(cms_apply, cpu_cms_block)

#include "cpu_cms_surrogate_loops_impl.h"

static const cpu_cms_kernels TM_CAT(cpu_cms_kernels_, TM_ISA_SUFFIX) = {
    .stats = cms_stats_any,
    .update = cms_update_any,
    .apply = cms_apply_any,
    .sur_gsq = sur_gsq_any,
    .sur_norms = sur_norms_any,
    .sur_grads = sur_grads_any,
};
