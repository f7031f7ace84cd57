/*
 * cpu_cms_surrogate_loops_impl.h -- the per-block loops of tm_cms_surrogate (CMS Phase 1, the
 * DirectUpdateMLP's surrogate training gradient, spec deep_nested_optimizer.md 7.2 and 7.4),
 * compiled per instruction set: cpu_cms_loops_impl.h includes it after its tile layer, whose
 * forward both passes reuse (so o is Phase 2's MLP output for the same inputs).
 * cpu_cms_surrogate.c drives the passes; the element math, the loss's formulas, the order of
 * every sum and the gradient's layout are tm_cms_surrogate.h's (shared with the CUDA kernels,
 * cuda/cms_surrogate.cu). Tiles of CMS_TILE elements,
 * one SIMD lane per element (a block's last tile is padded with zero inputs and o = 0, whose loss
 * gradient is 0: exact zeros in every sum):
 *   g^2 pass:      sum g^2 (no MLP)
 *   norms pass:    g, the features, the forward, sums of o^2, o g, (o - prev)^2
 *   gradient pass: the forward keeping each layer's SiLU output and derivative, d loss / d o from
 *                  the tensor's coefficients, o into outputs, sums of o^2 and (o - prev)^2, then
 *                  the backward: dW[j][k] += d_j x_k, db[j] += d_j, d down through W^T and SiLU'.
 * The weights' gradient is summed over the block in float with FMAs, in CPU_ACC lanes (element
 * e to lane e % 8, as every CPU reduction here: the same bits on every ISA and thread count),
 * each entry's lanes joined pairwise in double at the block's end.
 */

#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define SUR_MH TM_CMS_DIRECT_MAX_HIDDEN
_Static_assert(CPU_ACC == TM_SUR_LANES, "a block's lanes are tm_cms_surrogate.h's");

typedef struct {
    float g[CMS_TILE];
    float prev[CMS_TILE];                                 /* has_prev */
    float x[TM_CMS_DIRECT_IN][CMS_TILE];                  /* the features */
    float act[TM_CMS_MAX_LAYERS][SUR_MH][CMS_TILE];       /* SiLU outputs of each hidden layer */
    float dact[TM_CMS_MAX_LAYERS][SUR_MH][CMS_TILE];      /* their derivatives (gradient pass) */
    float out[CMS_TILE];                                  /* o */
} sur_tile;

/* g = target * scale / divisor (tm_sur_g). */
CPU_INLINE float
sur_g(const cpu_sur_block *b, float target)
{
    return tm_sur_g(target, b->scale, b->divisor);
}

/* g = target * scale / divisor, prev and the four features of elements [s, s + cnt). A partial
 * tile is padded with zero inputs, and after the forward with o = 0 (sur_tile_pad): every sum
 * and the loss gradient see exact zeros there. */
CPU_INLINE void
sur_tile_inputs(const cpu_sur_block *b, int64_t s, int cnt, tm_dtype dt, sur_tile *t)
{
    float raw[CMS_TILE], m[CMS_TILE];
    if (cnt == CMS_TILE) { /* full tiles: no masks, so the loops vectorize */
        TM_SIMD
        for (int e = 0; e < CMS_TILE; e++) {
            raw[e] = load_elem(b->target, s + e, dt);
            m[e] = b->m[s + e];
            t->prev[e] = b->has_prev ? b->out[s + e] : 0.0f;
        }
    } else {
        for (int e = 0; e < CMS_TILE; e++) {
            raw[e] = e < cnt ? load_elem(b->target, s + e, dt) : 0.0f;
            m[e] = e < cnt ? b->m[s + e] : 0.0f;
            t->prev[e] = b->has_prev && e < cnt ? b->out[s + e] : 0.0f;
        }
    }
    TM_SIMD
    for (int e = 0; e < CMS_TILE; e++) {
        const float g = sur_g(b, raw[e]);
        t->g[e] = g;
        tm_cms_preprocess(g, &t->x[0][e], &t->x[1][e]);
        tm_cms_preprocess(m[e], &t->x[2][e], &t->x[3][e]);
    }
}

CPU_INLINE void
sur_tile_pad(sur_tile *t, int cnt)
{
    for (int e = cnt; e < CMS_TILE; e++) {
        t->out[e] = 0.0f;
    }
}

/* The padded network on one tile, every hidden layer's output kept (and its derivative when
 * derivs). */
CPU_INLINE void
sur_tile_forward(const tm_cms_direct_net *net, sur_tile *t, int cnt, int derivs)
{
    const int32_t layers = net->layers;
    cms_tile_layer_d(&net->w_in[0][0], TM_CMS_DIRECT_IN, net->b_in, SUR_MH,
                     (const float (*)[CMS_TILE])t->x, t->act[0], 1, CMS_UNITS,
                     t->dact[0], derivs);
    for (int32_t l = 1; l < layers; l++) {
        cms_tile_layer_d(&net->w_hid[l - 1][0][0], SUR_MH, net->b_hid[l - 1], SUR_MH,
                         (const float (*)[CMS_TILE])t->act[l - 1], t->act[l], 1, CMS_UNITS,
                         t->dact[l], derivs);
    }
    cms_tile_layer(net->w_out, SUR_MH, &net->b_out, 1,
                   (const float (*)[CMS_TILE])t->act[layers - 1], (float (*)[CMS_TILE])t->out, 0,
                   1);
    sur_tile_pad(t, cnt);
}

/* The forward with and without derivatives as functions of their own: inlined into the large
 * gradient loop, the layer's element loop is not vectorized by GCC (it is not if-converted). */
#if defined(__GNUC__)
#define SUR_NOINLINE static __attribute__((noinline))
#else
#define SUR_NOINLINE static
#endif

SUR_NOINLINE void
sur_forward_plain(const tm_cms_direct_net *net, sur_tile *t, int cnt)
{
    sur_tile_forward(net, t, cnt, 0);
}

SUR_NOINLINE void
sur_forward_derivs(const tm_cms_direct_net *net, sur_tile *t, int cnt)
{
    sur_tile_forward(net, t, cnt, 1);
}

/* oo[lane] += o^2 and tt[lane] += (o - prev)^2 over the tile (0 in the padding). */
CPU_INLINE void
sur_tile_loss_sums(const sur_tile *t, double (*restrict oo)[CPU_ACC],
                   double (*restrict tt)[CPU_ACC])
{
    for (int e = 0; e < CMS_TILE; e += CPU_ACC) {
#pragma GCC unroll 8
        for (int j = 0; j < CPU_ACC; j++) {
            const double o = t->out[e + j];
            const double d = tm_fadd(t->out[e + j], -t->prev[e + j]);
            oo[0][j] = tm_sur_acc(oo[0][j], o, o);
            tt[0][j] = tm_sur_acc(tt[0][j], d, d);
        }
    }
}

/* sum g^2 over the block, g as sur_tile_inputs forms it. */
CPU_INLINE void
sur_gsq(const cpu_sur_block *b, tm_dtype dt)
{
    double acc[CPU_ACC] = {0.0};
    const int64_t full = b->n - b->n % CPU_ACC;
    for (int64_t i = 0; i < full; i += CPU_ACC) {
#pragma GCC unroll 8
        for (int j = 0; j < CPU_ACC; j++) {
            const double g = sur_g(b, load_elem(b->target, i + j, dt));
            acc[j] = tm_sur_acc(acc[j], g, g);
        }
    }
    for (int64_t i = full; i < b->n; i++) {
        const double g = sur_g(b, load_elem(b->target, i, dt));
        acc[i % CPU_ACC] = tm_sur_acc(acc[i % CPU_ACC], g, g);
    }
    b->parts[TM_SUR_GG] = tm_sur_join(acc);
    /* the other sums start at 0: passes N and G write those they compute */
    b->parts[TM_SUR_OO] = b->parts[TM_SUR_OG] = b->parts[TM_SUR_TT] = 0.0;
}

CPU_INLINE void
sur_norms(const cpu_sur_block *b, tm_dtype dt)
{
    sur_tile t;
    double acc[TM_SUR_NORM_PARTS][CPU_ACC] = {{0.0}};
    for (int64_t s = 0; s < b->n; s += CMS_TILE) {
        const int cnt = b->n - s < CMS_TILE ? (int)(b->n - s) : CMS_TILE;
        sur_tile_inputs(b, s, cnt, dt, &t);
        sur_forward_plain(b->net, &t, cnt);
        for (int e = 0; e < CMS_TILE; e += CPU_ACC) {
#pragma GCC unroll 8
            for (int j = 0; j < CPU_ACC; j++) {
                acc[TM_SUR_OG][j] = tm_sur_acc(acc[TM_SUR_OG][j], t.out[e + j], t.g[e + j]);
            }
        }
        sur_tile_loss_sums(&t, acc + TM_SUR_OO, acc + TM_SUR_TT);
    }
    b->parts[TM_SUR_OO] = tm_sur_join(acc[TM_SUR_OO]);
    b->parts[TM_SUR_OG] = tm_sur_join(acc[TM_SUR_OG]);
    b->parts[TM_SUR_TT] = tm_sur_join(acc[TM_SUR_TT]); /* parts[TM_SUR_GG] stays sur_gsq's */
}

/* acc[j * cols + k][lane] += d[j][e] x[k][e] over the tile (e % CPU_ACC = lane), for rows j in
 * [j0, j0 + jb) and columns k in [k0, k0 + 4): jb * 4 independent FMA chains (8 hide the FMA
 * latency), each d and x vector loaded once. */
#define SUR_KB 4
_Static_assert(SUR_MH % SUR_KB == 0 && TM_CMS_DIRECT_IN % SUR_KB == 0, "column blocks");

#if defined(__AVX2__) && defined(__FMA__)
/* One 8-float vector per lane group; _mm256_fmadd_ps rounds once per lane, as tm_fma: the
 * generic loop below gives the same bits. GCC vectorized that loop across the wrong dimension
 * (scalar FMAs and shuffles), a third of the gradient pass. */
_Static_assert(CPU_ACC == 8, "one __m256 per accumulator");

CPU_INLINE void
sur_outer_block(float (*restrict acc)[CPU_ACC], const float (*restrict d)[CMS_TILE],
                const float (*restrict x)[CMS_TILE], int32_t cols, int32_t j0, int32_t k0,
                int32_t jb)
{
    __m256 lane[2][SUR_KB];
    for (int32_t a = 0; a < jb; a++) {
        for (int32_t u = 0; u < SUR_KB; u++) {
            lane[a][u] = _mm256_loadu_ps(acc[(j0 + a) * cols + k0 + u]);
        }
    }
    for (int e = 0; e < CMS_TILE; e += CPU_ACC) {
        __m256 xv[SUR_KB];
        for (int32_t u = 0; u < SUR_KB; u++) {
            xv[u] = _mm256_loadu_ps(&x[k0 + u][e]);
        }
        for (int32_t a = 0; a < jb; a++) {
            const __m256 dv = _mm256_loadu_ps(&d[j0 + a][e]);
            for (int32_t u = 0; u < SUR_KB; u++) {
                lane[a][u] = _mm256_fmadd_ps(dv, xv[u], lane[a][u]);
            }
        }
    }
    for (int32_t a = 0; a < jb; a++) {
        for (int32_t u = 0; u < SUR_KB; u++) {
            _mm256_storeu_ps(acc[(j0 + a) * cols + k0 + u], lane[a][u]);
        }
    }
}
#else
CPU_INLINE void
sur_outer_block(float (*restrict acc)[CPU_ACC], const float (*restrict d)[CMS_TILE],
                const float (*restrict x)[CMS_TILE], int32_t cols, int32_t j0, int32_t k0,
                int32_t jb)
{
    for (int32_t c = 0; c < jb * SUR_KB; c++) {
        float *restrict lane = acc[(j0 + c / SUR_KB) * cols + k0 + c % SUR_KB];
        const float *restrict dj = d[j0 + c / SUR_KB];
        const float *restrict xk = x[k0 + c % SUR_KB];
        for (int e = 0; e < CMS_TILE; e += CPU_ACC) {
            for (int q = 0; q < CPU_ACC; q++) {
                lane[q] = tm_fma(dj[e + q], xk[e + q], lane[q]);
            }
        }
    }
}
#endif

/* The weights' gradient of one layer: dW[j][k] += d_j x_k for a [rows][cols] layer. */
CPU_INLINE void
sur_accum_outer(float (*restrict acc)[CPU_ACC], const float (*restrict d)[CMS_TILE],
                const float (*restrict x)[CMS_TILE], int32_t rows, int32_t cols)
{
    for (int32_t j = 0; j + 1 < rows; j += 2) {
        for (int32_t k = 0; k < cols; k += SUR_KB) {
            sur_outer_block(acc, d, x, cols, j, k, 2);
        }
    }
    if (rows % 2 == 1) {
        for (int32_t k = 0; k < cols; k += SUR_KB) {
            sur_outer_block(acc, d, x, cols, rows - 1, k, 1);
        }
    }
}

SUR_NOINLINE void
sur_outer_hidden(float (*restrict acc)[CPU_ACC], const float (*restrict d)[CMS_TILE],
                 const float (*restrict x)[CMS_TILE])
{
    sur_accum_outer(acc, d, x, SUR_MH, SUR_MH);
}

SUR_NOINLINE void
sur_outer_first(float (*restrict acc)[CPU_ACC], const float (*restrict d)[CMS_TILE],
                const float (*restrict x)[CMS_TILE])
{
    sur_accum_outer(acc, d, x, SUR_MH, TM_CMS_DIRECT_IN);
}

SUR_NOINLINE void
sur_outer_last(float (*restrict acc)[CPU_ACC], const float (*restrict d)[CMS_TILE],
               const float (*restrict x)[CMS_TILE])
{
    sur_accum_outer(acc, d, x, 1, SUR_MH);
}

/* acc[j][lane] += d[j][e] over the tile. */
CPU_INLINE void
sur_accum_rows(float (*restrict acc)[CPU_ACC], const float (*restrict d)[CMS_TILE], int32_t rows)
{
    for (int32_t j = 0; j < rows; j++) {
        for (int e = 0; e < CMS_TILE; e += CPU_ACC) {
#pragma GCC unroll 8
            for (int q = 0; q < CPU_ACC; q++) {
                acc[j][q] = tm_fadd(acc[j][q], d[j][e + q]);
            }
        }
    }
}

/* d loss / d o of the tile (0 in the padding); o into outputs. */
CPU_INLINE void
sur_tile_dout(const cpu_sur_block *b, int64_t s, int cnt, const sur_tile *t,
              float (*restrict dout)[CMS_TILE])
{
    const tm_sur_coefs c = {b->coef_o, b->coef_g, b->coef_t};
    TM_SIMD
    for (int e = 0; e < CMS_TILE; e++) {
        dout[0][e] = tm_sur_dout(&c, t->out[e], t->g[e], t->prev[e]);
    }
    float *restrict out = b->out + s;
    for (int e = 0; e < cnt; e++) {
        out[e] = t->out[e];
    }
}

/* y[k][e] = (sum_j W[j][k] x[j][e]) * dact[k][e]: the rows of one layer's input, from the rows
 * of its output. wt = W^T. */
SUR_NOINLINE void
sur_tile_down(const float *wt, const float (*restrict x)[CMS_TILE],
              const float (*restrict dact)[CMS_TILE], float (*restrict y)[CMS_TILE])
{
    static const float zero[SUR_MH] = {0.0f};
    cms_tile_layer(wt, SUR_MH, zero, SUR_MH, x, y, 0, CMS_UNITS);
    for (int32_t k = 0; k < SUR_MH; k++) {
        TM_SIMD
        for (int e = 0; e < CMS_TILE; e++) {
            y[k][e] = tm_fmul(y[k][e], dact[k][e]);
        }
    }
}

/* The backward of one tile, from dout = dloss/do: the weights' gradients accumulated into acc
 * (the module-order layout of tm_sur_entry_at, lane e % 8 of each entry). */
CPU_INLINE void
sur_tile_backward(const cpu_sur_block *b, const sur_tile *t, const float (*dout)[CMS_TILE],
                  float (*acc)[CPU_ACC])
{
    const tm_cms_direct_net *net = b->net;
    const int32_t layers = net->layers;
    const int64_t off_b_in = SUR_MH * TM_CMS_DIRECT_IN;
    const int64_t off_hid = off_b_in + SUR_MH;
    const int64_t hid = SUR_MH * SUR_MH + SUR_MH;
    const int64_t off_w_out = off_hid + (int64_t)(layers - 1) * hid;
    float d[2][SUR_MH][CMS_TILE];
    /* output layer: dW_out += dout a_{L-1}, db_out += dout; d = w_out dout * SiLU' */
    sur_outer_last(acc + off_w_out, dout, (const float (*)[CMS_TILE])t->act[layers - 1]);
    sur_accum_rows(acc + off_w_out + SUR_MH, dout, 1);
    for (int32_t k = 0; k < SUR_MH; k++) {
        const float w = net->w_out[k];
        TM_SIMD
        for (int e = 0; e < CMS_TILE; e++) {
            d[0][k][e] = tm_fmul(tm_fmul(w, dout[0][e]), t->dact[layers - 1][k][e]);
        }
    }
    int cur = 0;
    for (int32_t l = layers - 1; l >= 1; l--) { /* hidden layer l: act[l - 1] -> act[l] */
        float (*g)[CPU_ACC] = acc + off_hid + (int64_t)(l - 1) * hid;
        sur_outer_hidden(g, (const float (*)[CMS_TILE])d[cur],
                         (const float (*)[CMS_TILE])t->act[l - 1]);
        sur_accum_rows(g + SUR_MH * SUR_MH, (const float (*)[CMS_TILE])d[cur], SUR_MH);
        sur_tile_down(b->w_hid_t + (int64_t)(l - 1) * SUR_MH * SUR_MH,
                      (const float (*)[CMS_TILE])d[cur],
                      (const float (*)[CMS_TILE])t->dact[l - 1], d[cur ^ 1]);
        cur ^= 1;
    }
    sur_outer_first(acc, (const float (*)[CMS_TILE])d[cur], (const float (*)[CMS_TILE])t->x);
    sur_accum_rows(acc + off_b_in, (const float (*)[CMS_TILE])d[cur], SUR_MH);
}

CPU_INLINE void
sur_grads(const cpu_sur_block *b, tm_dtype dt)
{
    const tm_cms_direct_net *net = b->net;
    const int32_t layers = net->layers;
    const int64_t entries = tm_sur_grad_entries(layers);
    sur_tile t;
    float dout[1][CMS_TILE];
    float acc[TM_SUR_MAX_GRAD_ENTRIES][CPU_ACC];
    double sums[2][CPU_ACC] = {{0.0}}; /* o^2, (o - prev)^2: the loss of a tensor whose norms
                                          pass was skipped */
    memset(acc, 0, (size_t)entries * sizeof acc[0]); /* the entries of these layers only */
    for (int64_t s = 0; s < b->n; s += CMS_TILE) {
        const int cnt = b->n - s < CMS_TILE ? (int)(b->n - s) : CMS_TILE;
        sur_tile_inputs(b, s, cnt, dt, &t);
        sur_forward_derivs(net, &t, cnt);
        sur_tile_dout(b, s, cnt, &t, dout);
        sur_tile_loss_sums(&t, sums, sums + 1);
        sur_tile_backward(b, &t, (const float (*)[CMS_TILE])dout, acc);
    }
    b->parts[TM_SUR_OO] = tm_sur_join(sums[0]);
    b->parts[TM_SUR_TT] = tm_sur_join(sums[1]);
    double *grad = b->parts + TM_SUR_NORM_PARTS;
    for (int64_t q = 0; q < entries; q++) {
        double lanes[CPU_ACC];
        for (int j = 0; j < CPU_ACC; j++) {
            lanes[j] = acc[q][j];
        }
        grad[q] = tm_sur_join(lanes);
    }
}

CPU_DEFINE_BY_DTYPE(sur_gsq, cpu_sur_block)
CPU_DEFINE_BY_DTYPE(sur_norms, cpu_sur_block)
CPU_DEFINE_BY_DTYPE(sur_grads, cpu_sur_block)
