/*
 * tm_cms_surrogate.h -- the math of tm_cms_surrogate (CMS Phase 1, the DirectUpdateMLP's
 * surrogate training gradient; spec deep_nested_optimizer.md 7.2, loss 7.4), written once for the
 * CPU loops (cpu/cpu_cms_surrogate.c, cpu_cms_surrogate_loops_impl.h) and the CUDA kernels
 * (cuda/cms_surrogate.cu), so the two backends give the same bits: the target g, the SiLU
 * derivative, d loss / d o, the backward of a unit, the sums and their order, the loss and its
 * coefficients per tensor, and the layout of the weights' gradient.
 *
 * The algorithm (the pass structure: cpu_cms_surrogate.c): each tensor is cut into blocks of
 * TM_SUR_BLOCK elements from its start; per block, element e adds into lane e % TM_SUR_LANES of
 * every sum, lanes in element order: the sums of the loss in double (tm_sur_acc), the weights'
 * gradient in float with one FMA per element (dW[j][k] += d_j x_k; a bias adds d_j, the same
 * rounding as an FMA by 1); a block's lanes are joined pairwise in double (tm_sur_join), and the
 * blocks of the call are summed in block order in double. Every float operation is spelled with
 * tm_fmul / tm_fadd / tm_fdiv / tm_fma (and the double ones with tm_dmul / tm_dadd), so nvcc
 * contracts nothing the CPU build (-ffp-contract=off) does not. The forward is
 * tm_cms_direct_delta's operations, layer by layer (the CPU on tiles of SIMD lanes, CUDA one
 * element per thread): a unit sums its inputs in index order at the padded width, then SiLU by
 * tm_cms_silu_den. The backward of hidden layer l: d_(l-1)[k] = (sum_j W_l[j][k] d_l[j] in index
 * order, + 0) * SiLU'(v[k]) (tm_sur_down; the CPU evaluates it as a Linear layer of W_l^T with a
 * zero bias, the same operations in the same order).
 */
#ifndef TM_CMS_SURROGATE_H
#define TM_CMS_SURROGATE_H

#include <float.h>
#include <stdint.h>

#include "tm_cms_math.h"

#define TM_SUR_BLOCK 4096 /* elements per block: a tensor's block b holds [b * 4096, ...) */
#define TM_SUR_LANES 8    /* element e of a block adds into lane e % 8 of each sum */
#define TM_SUR_EPS 1e-8   /* the reference's threshold on both norms */

/* The per-block sums of the loss: o^2, o g, g^2, (o - prev)^2. */
enum { TM_SUR_OO, TM_SUR_OG, TM_SUR_GG, TM_SUR_TT, TM_SUR_NORM_PARTS };

/* Entries of the weights' gradient in the padded network's layout (module order: W_in [20][4],
 * b_in [20], (W [20][20], b [20]) x (L - 1), W_out [20], b_out). */
#define TM_SUR_GRAD_ENTRIES(L)                                                                     \
    (TM_CMS_DIRECT_MAX_HIDDEN * (TM_CMS_DIRECT_IN + 1) +                                           \
     ((L) - 1) * TM_CMS_DIRECT_MAX_HIDDEN * (TM_CMS_DIRECT_MAX_HIDDEN + 1) +                       \
     TM_CMS_DIRECT_MAX_HIDDEN + 1)
#define TM_SUR_MAX_GRAD_ENTRIES TM_SUR_GRAD_ENTRIES(TM_CMS_MAX_LAYERS)
#define TM_SUR_FIRST_ENTRIES (TM_CMS_DIRECT_MAX_HIDDEN * (TM_CMS_DIRECT_IN + 1))
#define TM_SUR_HIDDEN_ENTRIES (TM_CMS_DIRECT_MAX_HIDDEN * (TM_CMS_DIRECT_MAX_HIDDEN + 1))

TM_HOST_DEVICE int64_t
tm_sur_grad_entries(int32_t layers)
{
    return TM_SUR_GRAD_ENTRIES((int64_t)layers);
}

/* g = target * scale / divisor, the reference's float ops in its order; a non-finite g counts
 * as 0 (a NaN or Inf gradient element, or any element of a step the guard skipped when the
 * caller passes scale 0: it would turn the MLP's weights NaN for good, titanmac_cms.h). */
TM_HOST_DEVICE float
tm_sur_g(float target, float scale, float divisor)
{
    const float g = tm_fdiv(tm_fmul(target, scale), divisor);
    return fabsf(g) <= FLT_MAX ? g : 0.0f;
}

/* SiLU'(v) = s (1 + v (1 - s)), s = 1 / den, den = tm_cms_silu_den(v) shared with SiLU(v) =
 * v / den (torch's silu_backward). */
TM_HOST_DEVICE float
tm_sur_dsilu(float v, float den)
{
    const float sg = tm_fdiv(1.0f, den);
    return tm_fmul(sg, tm_fadd(1.0f, tm_fmul(v, tm_fadd(1.0f, -sg))));
}

/* d loss / d o of one tensor: co o + cg g + ct (o - prev), the coefficients with the 1 / count
 * of the mean over tensors (tm_sur_loss). */
typedef struct {
    float o, g, t;
} tm_sur_coefs;

TM_HOST_DEVICE float
tm_sur_dout(const tm_sur_coefs *c, float o, float g, float prev)
{
    const float d = tm_fadd(tm_fmul(c->o, o), tm_fmul(c->g, g));
    return tm_fadd(d, tm_fmul(c->t, tm_fadd(o, -prev)));
}

/* One unit of a layer with its inputs x[k * stride] (k < n): acc = w0 x0, acc += wk xk in index
 * order, + bias, as tm_cms_unit. */
TM_HOST_DEVICE float
tm_sur_unit(const float *w, const float *x, int32_t stride, int32_t n, float bias)
{
    float acc = tm_fmul(w[0], x[0]);
    TM_CMS_UNROLL
    for (int32_t k = 1; k < n; k++) {
        acc = tm_fmuladd(w[k], x[(int64_t)k * stride], acc);
    }
    return tm_fadd(acc, bias);
}

/* The backward through hidden weights W [20][20] (row-major) to input k: sum_j W[j][k] d[j]
 * (d[j * stride]) in index order, + 0 (the zero bias of the CPU's Linear of W^T). The caller
 * multiplies by SiLU' of that input. */
TM_HOST_DEVICE float
tm_sur_down(const float *w, int32_t k, const float *d, int32_t stride)
{
    const int32_t mh = TM_CMS_DIRECT_MAX_HIDDEN;
    float acc = tm_fmul(w[k], d[0]);
    TM_CMS_UNROLL
    for (int32_t j = 1; j < mh; j++) {
        acc = tm_fmuladd(w[j * mh + k], d[(int64_t)j * stride], acc);
    }
    return tm_fadd(acc, 0.0f);
}

/* acc + a b in double, the product rounded first: one element's term of a loss sum. */
TM_HOST_DEVICE double
tm_sur_acc(double acc, double a, double b)
{
    return tm_dadd(acc, tm_dmul(a, b));
}

/* A block's TM_SUR_LANES lanes of one sum, joined pairwise. */
TM_HOST_DEVICE double
tm_sur_join(const double *lane)
{
    return tm_dadd(tm_dadd(tm_dadd(lane[0], lane[1]), tm_dadd(lane[2], lane[3])),
                   tm_dadd(tm_dadd(lane[4], lane[5]), tm_dadd(lane[6], lane[7])));
}

/* One tensor's loss from its sums s (TM_SUR_NORM_PARTS, summed over its blocks in order), and
 * d loss / d o's coefficients divided by count into c. The reference's branches on the norms
 * (eps = 1e-8), each taken as torch's autograd differentiates it; a norm of 0 has gradient 0:
 *   R = 1 - cos(o, g) when ||g|| > eps and ||o|| > eps (else 0), P = ||o|| ||g||:
 *       d/do = -g / P + (o.g) o / (||o||^2 P)
 *   M = (||o|| / ||g|| - 1)^2 when ||g|| > eps:  d/do = 2 (||o|| / ||g|| - 1) o / (||g|| ||o||)
 *   M = ||o||^2 otherwise:                        d/do = 2 o
 *   T = mean((o - prev)^2) when has_prev:          d/do = 2 (o - prev) / numel
 *   loss = R + 0.1 M + 0.1 T.
 * The coefficients where ||g|| <= eps need only s[TM_SUR_GG] (the others may be 0 then). A
 * tensor of no elements with a previous output: loss NaN (the reference's mean over none). */
TM_HOST_DEVICE float
tm_sur_loss(const double *s, int64_t numel, int has_prev, int32_t count, tm_sur_coefs *c)
{
    const double on = sqrt(s[TM_SUR_OO]);
    const double gn = sqrt(s[TM_SUR_GG]);
    const double og = s[TM_SUR_OG];
    const int g_ok = gn > TM_SUR_EPS;
    double loss = 0.0, co = 0.0, cg = 0.0, ct = 0.0;
    if (g_ok && on > TM_SUR_EPS) {
        const double p = tm_dmul(on, gn);
        loss = tm_dadd(1.0, -(og / p));
        cg = -1.0 / p;
        co = og / tm_dmul(tm_dmul(on, on), p);
    }
    if (g_ok) {
        const double r = tm_dadd(on / gn, -1.0);
        loss = tm_dadd(loss, tm_dmul(0.1, tm_dmul(r, r)));
        co = tm_dadd(co, on > 0.0 ? tm_dmul(tm_dmul(0.1, 2.0), r) / tm_dmul(gn, on) : 0.0);
    } else {
        loss = tm_dadd(loss, tm_dmul(0.1, tm_dmul(on, on)));
        co = tm_dadd(co, tm_dmul(0.1, 2.0));
    }
    if (has_prev) {
        loss = tm_dadd(loss, tm_dmul(0.1, s[TM_SUR_TT] / (double)numel));
        ct = tm_dmul(0.1, 2.0) / (double)numel;
    }
    c->o = (float)(co / count);
    c->g = (float)(cg / count);
    c->t = (float)(ct / count);
    return (float)loss;
}

/* ---------------------------------------------------------------- gradient layout ---- */

/* Entry q of the padded gradient: its layer (0: the input layer, 1..L-1: hidden layer l, whose
 * weights are w_hid[l - 1]; L: the output layer), row j (output unit) and column k (input; -1:
 * the bias). */
typedef struct {
    int32_t layer, row, col;
} tm_sur_entry;

TM_HOST_DEVICE tm_sur_entry
tm_sur_entry_at(int64_t q, int32_t layers)
{
    const int32_t mh = TM_CMS_DIRECT_MAX_HIDDEN;
    const int64_t hidden_end = TM_SUR_FIRST_ENTRIES + (int64_t)(layers - 1) * TM_SUR_HIDDEN_ENTRIES;
    tm_sur_entry e;
    if (q < TM_SUR_FIRST_ENTRIES) {
        e.layer = 0;
        const int32_t i = (int32_t)q;
        const int bias = i >= mh * TM_CMS_DIRECT_IN;
        e.row = bias ? i - mh * TM_CMS_DIRECT_IN : i / TM_CMS_DIRECT_IN;
        e.col = bias ? -1 : i % TM_CMS_DIRECT_IN;
    } else if (q < hidden_end) {
        const int64_t h = (q - TM_SUR_FIRST_ENTRIES) / TM_SUR_HIDDEN_ENTRIES;
        const int32_t i = (int32_t)(q - TM_SUR_FIRST_ENTRIES - h * TM_SUR_HIDDEN_ENTRIES);
        const int bias = i >= mh * mh;
        e.layer = (int32_t)h + 1;
        e.row = bias ? i - mh * mh : i / mh;
        e.col = bias ? -1 : i % mh;
    } else {
        const int32_t i = (int32_t)(q - hidden_end);
        e.layer = layers;
        e.row = 0;
        e.col = i < mh ? i : -1;
    }
    return e;
}

/* The module's tensor of entry e (list(DirectUpdateMLP.parameters()) order: W_in, b_in, (W_l,
 * b_l) x (L - 1), W_out, b_out), in *weight, and the entry's index in it; -1 for an entry of
 * the padding (a unit or an input at or past `hidden`). */
TM_HOST_DEVICE int64_t
tm_sur_entry_index(tm_sur_entry e, int32_t hidden, int32_t layers, int32_t *weight)
{
    *weight = 2 * e.layer + (e.col < 0 ? 1 : 0);
    const int32_t cols = e.layer == 0 ? TM_CMS_DIRECT_IN : hidden;
    if (e.layer == layers) {
        return e.col < 0 ? 0 : (e.col < hidden ? e.col : -1);
    }
    if (e.row >= hidden || (e.col >= 0 && e.col >= cols)) {
        return -1;
    }
    return e.col < 0 ? e.row : (int64_t)e.row * cols + e.col;
}

#endif /* TM_CMS_SURROGATE_H */
