/*
 * cpu_cms_surrogate.c -- tm_cms_surrogate on the CPU: Phase 1 of the CMS step (spec
 * deep_nested_optimizer.md 7.2, loss 7.4), the DirectUpdateMLP's training gradient over the
 * chosen tensors, in passes over their blocks (the loops: cpu_cms_surrogate_loops_impl.h, per
 * instruction set):
 *
 *   Z  parallel: per block sum g^2 (no MLP)
 *   N  parallel: only for tensors with ||g|| > 1e-8, per block o = MLP(g, m) and the sums of o^2,
 *                o g, (o - prev)^2: the loss gradient needs the norms there. Elsewhere (every
 *                tensor under the reference's B1, spec section 14, whose g is zero) d loss / d o
 *                is known without them, and the loss's sums come from pass G.
 *   L  serial:   per tensor the loss (normed tensors) and d loss / d o
 *                = co o + cg g + ct (o - prev)
 *   G  parallel: per block the forward (again, for normed tensors: cheaper than keeping the
 *                activations, [numel, 20] floats per layer in the reference's autograd), o into
 *                outputs, the sums of o^2 and (o - prev)^2, the backward into the block's
 *                gradient partials
 *   W  serial:   the other tensors' losses; the partials summed in block order, over every
 *                tensor, into weight_grads
 *
 * The loss, its gradient with respect to o, the element math and the order of every sum are
 * tm_cms_surrogate.h's, shared with the CUDA kernels (cuda/cms_surrogate.cu): the same bits.
 *
 * Scratch: double parts[blocks][4 + gradient entries] (the sums, then the gradient), then
 * sur_coefs[count].
 */
#include <math.h>

#include "../common/tm_tensor.h"
#include "cpu_ops.h"

/* Per tensor: d loss / d o's coefficients (with the 1 / count of the mean over tensors),
 * whether pass N runs for it, its first block. */
typedef struct {
    tm_sur_coefs c;
    int32_t normed;
    int64_t first;
} sur_coefs;

typedef struct {
    const tm_cms_surrogate_tensors *t;
    const tm_cms_surrogate_args *a;
    const tm_cms_direct_net *net;
    const float *w_hid_t;
    float scale;
    int64_t stride; /* doubles per block in parts */
    double *parts;
    sur_coefs *coefs;   /* [count] */
    void (*fn)(const cpu_sur_block *);
    int only_normed;    /* pass N: skip the tensors with ||g|| <= eps */
} sur_ctx;

static int64_t
parts_per_block(int32_t layers)
{
    const int32_t l = layers < 1 ? 1 : (layers > TM_CMS_MAX_LAYERS ? TM_CMS_MAX_LAYERS : layers);
    return TM_SUR_NORM_PARTS + tm_sur_grad_entries(l);
}

size_t
cpu_cms_surrogate_scratch_bytes(const tm_tensor_list *targets, int32_t layers)
{
    if (targets == NULL || targets->count <= 0 || targets->tensors == NULL) {
        return 0;
    }
    return (size_t)cpu_count_blocks(targets) * (size_t)parts_per_block(layers) * sizeof(double) +
           (size_t)targets->count * sizeof(sur_coefs);
}

static int
has_prev(const tm_cms_surrogate_args *a, int32_t i)
{
    return a->has_prev != NULL && a->has_prev[i] != 0;
}

/* s = tensor i's sums, its blocks' summed in block order. */
static void
sum_blocks(const sur_ctx *x, int32_t i, double *s)
{
    cpu_sum_blocks(x->parts + x->coefs[i].first * x->stride, x->stride,
                   cpu_blocks_of(x->t->targets.tensors[i].numel), TM_SUR_NORM_PARTS, s);
}

static void
sur_segment(void *vctx, int32_t i, int64_t b0, int64_t b1, int64_t global_block)
{
    const sur_ctx *x = vctx;
    if (x->only_normed && !x->coefs[i].normed) {
        return;
    }
    const tm_tensor *target = &x->t->targets.tensors[i];
    cpu_sur_block blk = {
        .dtype = target->dtype,
        .has_prev = has_prev(x->a, i),
        .scale = x->scale,
        .divisor = (float)x->a->divisor,
        .net = x->net,
        .w_hid_t = x->w_hid_t,
    };
    blk.coef_o = x->coefs[i].c.o;
    blk.coef_g = x->coefs[i].c.g;
    blk.coef_t = x->coefs[i].c.t;
    for (int64_t b = b0; b < b1; b++) {
        int64_t off;
        blk.n = cpu_segment_elems(target->numel, b, b + 1, &off);
        blk.target = cpu_elem_ptr(target, off);
        blk.m = (const float *)x->t->momentum.tensors[i].data + off;
        blk.out = (float *)x->t->outputs.tensors[i].data + off;
        blk.parts = x->parts + (global_block + b - b0) * x->stride;
        x->fn(&blk);
    }
}

/* Step W: every entry of the padded layout summed over all blocks, into its weight's real
 * entry (tm_sur_entry_index). */
static void
write_grads(const sur_ctx *x, int64_t blocks, int32_t hidden, int32_t layers)
{
    const int64_t entries = tm_sur_grad_entries(layers);
    double grad[TM_SUR_MAX_GRAD_ENTRIES];
    cpu_sum_blocks(x->parts + TM_SUR_NORM_PARTS, x->stride, blocks, entries, grad);
    for (int64_t q = 0; q < entries; q++) {
        int32_t k;
        const int64_t at = tm_sur_entry_index(tm_sur_entry_at(q, layers), hidden, layers, &k);
        if (at >= 0) {
            ((float *)x->t->weight_grads.tensors[k].data)[at] = (float)grad[q];
        }
    }
}

/* No targets: the mean over none has no gradient; the weights' gradients are zero. */
static void
zero_weight_grads(const tm_tensor_list *weight_grads)
{
    for (int32_t k = 0; k < weight_grads->count; k++) {
        float *g = weight_grads->tensors[k].data;
        for (int64_t i = 0; i < weight_grads->tensors[k].numel; i++) {
            g[i] = 0.0f;
        }
    }
}

/* The padded network from the module's weights (validated: 2 L + 2 tensors), and its hidden
 * layers transposed (w_hid_t[l][k][j] = W_l[j][k]: the backward multiplies by W^T). */
static void
load_net(const tm_tensor_list *weights, const tm_cms_surrogate_args *a, tm_cms_direct_net *net,
         float w_hid_t[][TM_CMS_DIRECT_MAX_HIDDEN][TM_CMS_DIRECT_MAX_HIDDEN])
{
    const int32_t mh = TM_CMS_DIRECT_MAX_HIDDEN;
    const float *w[2 * TM_CMS_MAX_LAYERS + 2];
    for (int32_t k = 0; k < weights->count; k++) {
        w[k] = weights->tensors[k].data;
    }
    tm_cms_direct_fill(net, w, a->hidden, a->layers, 0, 1);
    for (int32_t l = 0; l + 1 < a->layers; l++) {
        for (int32_t j = 0; j < mh; j++) {
            for (int32_t k = 0; k < mh; k++) {
                w_hid_t[l][k][j] = net->w_hid[l][j][k];
            }
        }
    }
}

tm_status
cpu_cms_surrogate(const tm_cms_surrogate_tensors *t, const tm_cms_surrogate_args *a,
                  const tm_cms_surrogate_inputs *in, const tm_exec *exec)
{
    const int32_t count = t->targets.count;
    if (count == 0) {
        zero_weight_grads(&t->weight_grads);
        return TM_OK;
    }
    tm_cms_direct_net net;
    float w_hid_t[TM_CMS_MAX_LAYERS - 1][TM_CMS_DIRECT_MAX_HIDDEN][TM_CMS_DIRECT_MAX_HIDDEN];
    load_net(&t->weights, a, &net, w_hid_t);
    const int64_t blocks = cpu_count_blocks(&t->targets);
    sur_ctx x = {
        .t = t,
        .a = a,
        .net = &net,
        .w_hid_t = &w_hid_t[0][0][0],
        .scale = tm_tensor_given(&in->scale) ? *(const float *)in->scale.data : 1.0f,
        .stride = parts_per_block(a->layers),
        .parts = exec->scratch,
    };
    x.coefs = (sur_coefs *)(x.parts + blocks * x.stride);
    int64_t first = 0;
    for (int32_t i = 0; i < count; i++) {
        x.coefs[i] = (sur_coefs){.first = first};
        first += cpu_blocks_of(t->targets.tensors[i].numel);
    }
    const cpu_cms_kernels *k = cpu_active_kernels()->cms;
    x.fn = k->sur_gsq;
    cpu_for_each_block(&t->targets, exec, sur_segment, &x);
    double s[TM_SUR_NORM_PARTS];
    for (int32_t i = 0; i < count; i++) {
        sum_blocks(&x, i, s);
        x.coefs[i].normed = sqrt(s[TM_SUR_GG]) > TM_SUR_EPS;
    }
    x.fn = k->sur_norms;
    x.only_normed = 1;
    cpu_for_each_block(&t->targets, exec, sur_segment, &x);
    x.only_normed = 0;
    float *losses = in->losses.data;
    for (int32_t i = 0; i < count; i++) {
        sum_blocks(&x, i, s);
        if (!x.coefs[i].normed) { /* the coefficients need only sum g^2; the loss comes later */
            s[TM_SUR_OO] = s[TM_SUR_OG] = s[TM_SUR_TT] = 0.0;
        }
        losses[i] = tm_sur_loss(s, t->targets.tensors[i].numel, has_prev(a, i), count,
                                &x.coefs[i].c);
    }
    x.fn = k->sur_grads;
    cpu_for_each_block(&t->targets, exec, sur_segment, &x);
    for (int32_t i = 0; i < count; i++) {
        if (!x.coefs[i].normed) {
            tm_sur_coefs same;
            sum_blocks(&x, i, s);
            losses[i] = tm_sur_loss(s, t->targets.tensors[i].numel, has_prev(a, i), count,
                                    &same);
        }
    }
    write_grads(&x, blocks, a->hidden, a->layers);
    return TM_OK;
}
