/*
 * cpu_cms.c -- the DeepNestedOptimizer's CMS update on the CPU (tm_cms_step): Phase 2 of spec
 * deep_nested_optimizer.md 7.2 for every tensor, as the reference's _cms_update_param, in fused
 * passes over the blocks of all tensors (the loops: cpu_cms_loops_impl.h, per instruction set):
 *
 *   [LEGACY] S  parallel: per (block, firing level) shifted sums of m_l and g^_l
 *   [LEGACY] C  serial:   per (tensor, level) stats -> L2RegressionMomentum -> (a, b, 1 - d)
 *            A  parallel: A_l += g for non-firing levels; for firing ones g^ = (A_l + g) / div,
 *                         e_l, v_l, m' (DIRECT: 0.9 m + 0.1 delta, delta parked in A_l; LEGACY:
 *                         a m + b g^, A_l = 0) into m_l; partial sums of g^2, m'^2, delta^2
 *            F  serial:   per (tensor, level) clamp scale r / ||m'||, ok = finite contribution;
 *                         per tensor n_ok and the overflow bound; step_counts += 1
 *            B  parallel: m_l *= scale; u = sum of ok contributions; p -= lr (u / sqrt(n) + wd p)
 *
 * Parking delta in A_l (dead until B zeroes it) is what saves a second evaluation of the MLP, or
 * a delta buffer in scratch: A reads each state tensor once and writes it once, B touches only
 * m_l, A_l (DIRECT) and p of firing levels. A nonzero skip[0] returns before any pass. Partial
 * sums are per block in double, combined in block order: no dependence on the thread count.
 *
 * Scratch: double parts[blocks][levels][P] (P = 3 DIRECT, 7 LEGACY), then
 * tm_cms_level_out[count][levels], then tm_cms_tensor_out[count].
 */
#include "../common/tm_half.h"
#include "../common/tm_tensor.h"
#include "cpu_ops.h"

typedef struct {
    const tm_cms_tensors *t;
    const tm_cms_args *a;
    const tm_cms_consts *c;
    const tm_cms_direct_net *net;
    const float *lr;
    float grad_scale;
    int32_t levels;
    int32_t parts; /* P */
    double *part;
    tm_cms_level_out *lv;
    tm_cms_tensor_out *tv;
    void (*fn)(const cpu_cms_block *);
    int stats_pass; /* pass S: the blocks need the LEGACY shifts (read before pass A writes) */
} cms_ctx;

size_t
cpu_cms_scratch_bytes(const tm_tensor_list *params, int32_t levels, tm_cms_net net)
{
    if (params == NULL || params->count <= 0 || params->tensors == NULL) {
        return 0;
    }
    return tm_cms_scratch_layout_bytes((size_t)cpu_count_blocks(params), (size_t)params->count,
                                       levels, net);
}

/* g^_l of element 0 of tensor i, as the loops compute it (the LEGACY stats' shift). */
static float
first_level_grad(const cms_ctx *x, int32_t i, int32_t l)
{
    const tm_tensor *g = &x->t->grads.tensors[i];
    const float acc = ((const float *)x->t->accumulated[l].tensors[i].data)[0];
    if (g->dtype == TM_FLOAT64) { /* the accumulate in double (tm_cms_acc_add_wide) */
        const double v = ((const double *)g->data)[0] * (double)x->grad_scale;
        return tm_fdiv(tm_cms_acc_add_wide(acc, v), x->c->div[l]);
    }
    float v;
    if (g->dtype == TM_FLOAT32) {
        v = ((const float *)g->data)[0];
    } else {
        const uint16_t h = ((const uint16_t *)g->data)[0];
        v = g->dtype == TM_BFLOAT16 ? tm_bf16_to_f32(h) : tm_f16_to_f32(h);
    }
    v = v * x->grad_scale;
    if (g->dtype != TM_FLOAT32) {
        v = g->dtype == TM_BFLOAT16 ? tm_bf16_to_f32(tm_f32_to_bf16(v))
                                    : tm_f16_to_f32(tm_f32_to_f16(v));
    }
    return tm_fdiv(tm_fadd(acc, v), x->c->div[l]); /* the accumulate, the clone's division */
}

/* Block b of tensor i, whose partials go to slot. */
static void
cms_block(const cms_ctx *x, int32_t i, int64_t b, int64_t slot, cpu_cms_block *blk)
{
    const tm_cms_tensors *t = x->t;
    const tm_tensor *p = &t->params.tensors[i];
    int64_t off;
    blk->n = cpu_segment_elems(p->numel, b, b + 1, &off);
    blk->p = cpu_elem_ptr(p, off);
    blk->g = cpu_elem_ptr(&t->grads.tensors[i], off);
    for (int32_t l = 0; l < x->levels; l++) {
        blk->m[l] = (float *)t->momentum[l].tensors[i].data + off;
        blk->acc[l] = (float *)t->accumulated[l].tensors[i].data + off;
        blk->ema[l] = t->ema[l].count > 0 ? (float *)t->ema[l].tensors[i].data + off : NULL;
        blk->vsq[l] = t->v_sq[l].count > 0 ? (float *)t->v_sq[l].tensors[i].data + off : NULL;
        const int shift = x->stats_pass && (x->c->fires >> l & 1u);
        blk->shift_m[l] = shift ? ((const float *)t->momentum[l].tensors[i].data)[0] : 0.0f;
        blk->shift_g[l] = shift ? first_level_grad(x, i, l) : 0.0f;
    }
    blk->dtype = p->dtype;
    blk->legacy = x->a->net == TM_CMS_LEGACY;
    blk->grad_scale = x->grad_scale;
    blk->lr = x->lr[x->a->group_of != NULL ? x->a->group_of[i] : 0];
    blk->c = x->c;
    blk->net = x->net;
    blk->lv = x->lv + (int64_t)i * x->levels;
    blk->tv = x->tv + i;
    blk->parts = x->part + slot * x->levels * x->parts;
}

static void
cms_segment(void *vctx, int32_t i, int64_t b0, int64_t b1, int64_t global_block)
{
    const cms_ctx *x = vctx;
    cpu_cms_block blk;
    for (int64_t b = b0; b < b1; b++) {
        cms_block(x, i, b, global_block + (b - b0), &blk);
        x->fn(&blk);
    }
}

/* out[q] = sum over blocks [first, first + nb) of part q of level l, in block order. */
static void
combine(const cms_ctx *x, int64_t first, int64_t nb, int32_t l, int32_t count, double *out)
{
    const int64_t stride = (int64_t)x->levels * x->parts;
    cpu_sum_blocks(x->part + first * stride + (int64_t)l * x->parts, stride, nb, count, out);
}

/* Step C: (a, b, 1 - d) of every firing (tensor, level) from its stats and the context;
 * context: NULL, or the (t, base_lr) given in memory instead of the arguments'. */
static void
legacy_coeffs(const cms_ctx *x, const float *const *w, float loss, const double *context)
{
    float in[TM_CMS_LEGACY_IN];
    float act[2 * TM_CMS_LEGACY_MAX_HIDDEN];
    int64_t first = 0;
    tm_cms_context(in + 6, context != NULL ? context[0] : x->a->t,
                   context != NULL ? context[1] : x->a->base_lr, loss);
    for (int32_t i = 0; i < x->t->params.count; i++) {
        const int64_t numel = x->t->params.tensors[i].numel;
        const int64_t nb = cpu_blocks_of(numel);
        for (int32_t l = 0; l < x->levels; l++) {
            if (!(x->c->fires >> l & 1u)) {
                continue;
            }
            double s[TM_CMS_LEGACY_PARTS - 1];
            combine(x, first, nb, l, TM_CMS_LEGACY_PARTS - 1, s);
            const float km = numel > 0 ? ((const float *)x->t->momentum[l].tensors[i].data)[0] : 0;
            const float kg = numel > 0 ? first_level_grad(x, i, l) : 0.0f;
            tm_cms_stats(s, km, numel, in);
            tm_cms_stats(s + 3, kg, numel, in + 3);
            tm_cms_legacy_coeffs(&x->lv[(int64_t)i * x->levels + l], w, x->a->hidden,
                                 x->a->layers, in, act);
        }
        first += nb;
    }
}

/* Step F: clamp scales, ok flags, n_ok, the overflow bound, step counts. */
static void
finish(const cms_ctx *x)
{
    const int legacy = x->a->net == TM_CMS_LEGACY;
    int64_t first = 0;
    for (int32_t i = 0; i < x->t->params.count; i++) {
        const int64_t numel = x->t->params.tensors[i].numel;
        const int64_t nb = cpu_blocks_of(numel);
        float *steps = x->t->step_counts.tensors[i].data;
        double bound = 0.0;
        int32_t n_ok = 0;
        for (int32_t l = 0; l < x->levels; l++) {
            tm_cms_level_out *o = &x->lv[(int64_t)i * x->levels + l];
            if (!legacy) {
                o->a = o->b = o->omd = 0.0f;
            }
            o->fired = o->ok = 0;
            if (x->c->fires >> l & 1u) {
                double sums[TM_CMS_LEGACY_PARTS];
                combine(x, first, nb, l, x->parts, sums);
                bound += tm_cms_finish_level(o, sums, legacy, numel, x->c->clamp_ratio);
                n_ok += o->ok;
                steps[l] = steps[l] + 1.0f;
            }
        }
        tm_cms_finish_tensor(&x->tv[i], n_ok, bound);
        first += nb;
    }
}

tm_status
cpu_cms_step(const tm_cms_tensors *t, const tm_cms_args *a, const tm_cms_inputs *in,
             const tm_exec *exec)
{
    if (t->params.count == 0 ||
        (tm_tensor_given(&in->skip) && *(const float *)in->skip.data != 0.0f)) {
        return TM_OK;
    }
    const tm_cms_consts c = tm_cms_consts_make(a);
    const float *w[2 * TM_CMS_MAX_LAYERS + 3];
    for (int32_t i = 0; i < t->weights.count; i++) { /* validated: <= 2 L + 3 */
        w[i] = t->weights.tensors[i].data;
    }
    tm_cms_direct_net net;
    if (a->net == TM_CMS_DIRECT) {
        tm_cms_direct_fill(&net, w, a->hidden, a->layers, 0, 1);
    }
    const int64_t blocks = cpu_count_blocks(&t->params);
    cms_ctx x = {
        .t = t,
        .a = a,
        .c = &c,
        .net = &net,
        .lr = in->lr.data,
        .grad_scale = tm_tensor_given(&in->grad_scale) ? *(const float *)in->grad_scale.data : 1.0f,
        .levels = a->levels,
        .parts = tm_cms_parts_of(a->net),
        .part = exec->scratch,
    };
    x.lv = (tm_cms_level_out *)(x.part + blocks * a->levels * x.parts);
    x.tv = (tm_cms_tensor_out *)(x.lv + (int64_t)t->params.count * a->levels);
    const cpu_cms_kernels *k = cpu_active_kernels()->cms;
    if (a->net == TM_CMS_LEGACY) {
        x.fn = k->stats;
        x.stats_pass = 1;
        cpu_for_each_block(&t->params, exec, cms_segment, &x);
        x.stats_pass = 0;
        legacy_coeffs(&x, w, *(const float *)in->loss.data,
                      tm_tensor_given(&in->context) ? in->context.data : NULL);
    }
    x.fn = k->update;
    cpu_for_each_block(&t->params, exec, cms_segment, &x);
    finish(&x);
    x.fn = k->apply;
    cpu_for_each_block(&t->params, exec, cms_segment, &x);
    return TM_OK;
}
