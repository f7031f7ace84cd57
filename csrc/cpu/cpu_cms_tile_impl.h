/*
 * cpu_cms_tile_impl.h -- the DirectUpdateMLP evaluated on a tile of CMS_TILE elements, one SIMD
 * lane per element (Phase 2 of the CMS step, and with derivatives Phase 1's surrogate gradient),
 * compiled once per instruction set: cpu_cms_loops_impl.h includes it after its element helpers.
 *
 * The DirectUpdateMLP is the hot loop (~2,000 flops per element and firing level at H = 20,
 * L = 2, half of them in the 40 SiLUs). It runs on tiles of CMS_TILE elements, one Linear layer
 * at a time, CMS_UNITS units and CMS_LANES elements at a time: each unit's sum over k in index
 * order (fully unrolled) in a vector of the lanes, then a vectorized loop of the lanes' SiLUs, so
 * each SIMD lane is one element doing exactly tm_cms_direct_delta's operations (the tail of a
 * block calls that function itself: bitwise the same, tested). Measured (AVX-512, H = 20,
 * L = 2): ~27 ns per element and core, about 60% of it in the 40 exps (Cephes, ~33 vector
 * operations each, 25 since tm_cms_silu_den); FMA in the sums would save only ~4%.
 *
 * The sums are written with a vector type, not as a loop the compiler vectorizes: GCC vectorized
 * the element loop around them, clang (14) did not, and its CMS step was 12x slower.
 */

typedef struct {
    float gh[CMS_TILE];                                     /* g^ */
    float m[CMS_TILE];                                      /* m_l before the update */
    float act[2][TM_CMS_DIRECT_MAX_HIDDEN][CMS_TILE];       /* features, then layer outputs */
    float out[CMS_TILE];                                    /* delta */
} cms_tile;

/* y[j] = act(W[j] . x + b[j]) for every unit j, one SIMD lane per element. `in` is a constant
 * at each call, so the sum over k unrolls into straight-line code. Units go CMS_UNITS at a time:
 * independent sums (and SiLUs) in flight hide the add and divide latencies of each, and each
 * x[k] is loaded once for all of them. Every unit's operations and their order are
 * tm_cms_unit's. */
#define CMS_UNITS 4
_Static_assert(TM_CMS_DIRECT_MAX_HIDDEN % CMS_UNITS == 0, "hidden layers go CMS_UNITS at a time");
/* CMS_LANES elements as one value of the GCC/clang vector extension: its * and + act element by
 * element, each rounded once as the scalar code's (no FMA: -ffp-contract=off); the compiler
 * splits it into the ISA's registers (one on AVX-512, two on AVX2, four on SSE2 and NEON). */
#define CMS_LANES 16
_Static_assert(CMS_TILE % CMS_LANES == 0, "a tile is whole lane groups");
typedef float cms_lanes __attribute__((vector_size(CMS_LANES * sizeof(float))));

CPU_INLINE void
cms_tile_layer_d(const float *w, int32_t in, const float *bias, int32_t out,
                 const float (*restrict x)[CMS_TILE], float (*restrict y)[CMS_TILE], int silu,
                 int32_t units, float (*restrict dy)[CMS_TILE], int derivs)
{
    for (int32_t j = 0; j < out; j += units) {
        const float *wj = w + (int64_t)j * in;
        for (int e0 = 0; e0 < CMS_TILE; e0 += CMS_LANES) {
            cms_lanes acc[CMS_UNITS];
            cms_lanes x0, xk;
            memcpy(&x0, &x[0][e0], sizeof x0);
#pragma GCC unroll 4
            for (int32_t u = 0; u < units; u++) {
                acc[u] = wj[u * in] * x0;
            }
#pragma GCC unroll 20
            for (int32_t k = 1; k < in; k++) {
                memcpy(&xk, &x[k][e0], sizeof xk);
#pragma GCC unroll 4
                for (int32_t u = 0; u < units; u++) {
                    acc[u] = acc[u] + wj[u * in + k] * xk;
                }
            }
            float sums[CMS_UNITS][CMS_LANES];
            memcpy(sums, acc, (size_t)units * sizeof acc[0]);
#pragma GCC unroll 4
            for (int32_t u = 0; u < units; u++) {
                TM_SIMD
                for (int e = 0; e < CMS_LANES; e++) {
                    const float v = sums[u][e] + bias[j + u];
                    /* tm_cms_silu(v), its operations spelled out to share 1 + e^-v with SiLU's
                     * derivative (tm_sur_dsilu, torch's silu_backward) */
                    const float den = tm_cms_silu_den(v);
                    y[j + u][e0 + e] = silu ? tm_fdiv(v, den) : v;
                    if (derivs) {
                        dy[j + u][e0 + e] = tm_sur_dsilu(v, den);
                    }
                }
            }
        }
    }
}

/* The layer without derivatives (Phase 2). */
CPU_INLINE void
cms_tile_layer(const float *w, int32_t in, const float *bias, int32_t out,
               const float (*restrict x)[CMS_TILE], float (*restrict y)[CMS_TILE], int silu,
               int32_t units)
{
    float unused[1][CMS_TILE];
    cms_tile_layer_d(w, in, bias, out, x, y, silu, units, unused, 0);
}

/* The padded network (see tm_cms_direct_delta) on one tile. */
CPU_INLINE void
cms_tile_mlp(const tm_cms_direct_net *net, cms_tile *t)
{
    const int32_t mh = TM_CMS_DIRECT_MAX_HIDDEN;
    int cur = 1;
    cms_tile_layer(&net->w_in[0][0], TM_CMS_DIRECT_IN, net->b_in, mh,
                   (const float (*)[CMS_TILE])t->act[0], t->act[1], 1, CMS_UNITS);
    for (int32_t l = 0; l + 1 < net->layers; l++) {
        cms_tile_layer(&net->w_hid[l][0][0], mh, net->b_hid[l], mh,
                       (const float (*)[CMS_TILE])t->act[cur], t->act[cur ^ 1], 1, CMS_UNITS);
        cur ^= 1;
    }
    cms_tile_layer(net->w_out, mh, &net->b_out, 1, (const float (*)[CMS_TILE])t->act[cur],
                   (float (*)[CMS_TILE])t->out, 0, 1);
}
