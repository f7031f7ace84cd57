/*
 * cpu_cms_surrogate.c -- tm_cms_surrogate on the CPU: Phase 1 of the CMS step (spec
 * deep_nested_optimizer.md 7.2, loss 7.4), the DirectUpdateMLP's training gradient over the
 * chosen tensors, in two passes over their blocks (the loops: cpu_cms_surrogate_loops_impl.h,
 * per instruction set):
 *
 *   N  parallel: per block o = MLP(g, m) and the sums of o^2, o g, g^2, (o - prev)^2
 *   L  serial:   per tensor the norms, the loss and d loss / d o = co o + cg g + ct (o - prev)
 *   G  parallel: per block the forward again, o into outputs, the backward into the block's
 *                gradient partials. Running the forward twice costs less than keeping the
 *                activations: the reference's autograd holds [numel, 20] floats per layer.
 *   W  serial:   the partials summed in block order, over every tensor, into weight_grads
 *
 * The loss terms and their gradients (the reference's branches on the norms, eps = 1e-8, each
 * taken as torch's autograd differentiates it; a norm of 0 has gradient 0):
 *   R = 1 - cos(o, g) when ||g|| > eps and ||o|| > eps (else 0; F.cosine_similarity clamps each
 *       norm to >= eps, a no-op here), P = ||o|| ||g||:  d/do = -g / P + (o.g) o / (||o||^2 P)
 *   M = (||o|| / ||g|| - 1)^2 when ||g|| > eps:  d/do = 2 (||o|| / ||g|| - 1) o / (||g|| ||o||)
 *   M = ||o||^2 otherwise:                        d/do = 2 o
 *   T = mean((o - prev)^2) when has_prev:          d/do = 2 (o - prev) / numel
 *   loss = R + 0.1 M + 0.1 T, and the coefficients carry the 1 / count of the mean over tensors.
 *
 * Scratch: double parts[blocks][max(4, gradient entries)], then float coefs[count][3].
 */
#include <math.h>

#include "../common/tm_tensor.h"
#include "cpu_ops.h"

typedef struct {
    const tm_cms_surrogate_tensors *t;
    const tm_cms_surrogate_args *a;
    const tm_cms_direct_net *net;
    const float *w_hid_t;
    float scale;
    int64_t stride; /* doubles per block in parts */
    double *parts;
    const float *coefs; /* [count][3], pass G */
    void (*fn)(const cpu_sur_block *);
} sur_ctx;

static int64_t
parts_per_block(int32_t layers)
{
    const int32_t l = layers < 1 ? 1 : (layers > TM_CMS_MAX_LAYERS ? TM_CMS_MAX_LAYERS : layers);
    const int64_t g = cpu_sur_grad_entries(l);
    return g > CPU_SUR_NORM_PARTS ? g : CPU_SUR_NORM_PARTS;
}

size_t
cpu_cms_surrogate_scratch_bytes(const tm_tensor_list *targets, int32_t layers)
{
    if (targets == NULL || targets->count <= 0 || targets->tensors == NULL) {
        return 0;
    }
    return (size_t)cpu_count_blocks(targets) * (size_t)parts_per_block(layers) * sizeof(double) +
           (size_t)targets->count * 3 * sizeof(float);
}

static void
sur_segment(void *vctx, int32_t i, int64_t b0, int64_t b1, int64_t global_block)
{
    const sur_ctx *x = vctx;
    const tm_tensor *target = &x->t->targets.tensors[i];
    cpu_sur_block blk = {
        .dtype = target->dtype,
        .has_prev = x->a->has_prev != NULL && x->a->has_prev[i] != 0,
        .scale = x->scale,
        .divisor = (float)x->a->divisor,
        .net = x->net,
        .w_hid_t = x->w_hid_t,
    };
    if (x->coefs != NULL) {
        blk.coef_o = x->coefs[3 * i];
        blk.coef_g = x->coefs[3 * i + 1];
        blk.coef_t = x->coefs[3 * i + 2];
    }
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

/* Step L for one tensor: its loss, and d loss / d o's coefficients (/ count) into c[3]. */
static float
loss_and_coefs(const double *s, int64_t numel, int has_prev, int32_t count, float *c)
{
    const double eps = 1e-8;
    const double on = sqrt(s[CPU_SUR_OO]);
    const double gn = sqrt(s[CPU_SUR_GG]);
    const double og = s[CPU_SUR_OG];
    const int g_ok = gn > eps;
    double loss = 0.0, co = 0.0, cg = 0.0, ct = 0.0;
    if (g_ok && on > eps) {
        const double p = on * gn;
        loss = 1.0 - og / p;
        cg = -1.0 / p;
        co = og / (on * on * p);
    }
    if (g_ok) {
        const double r = on / gn - 1.0;
        loss += 0.1 * (r * r);
        co += on > 0.0 ? 0.1 * 2.0 * r / (gn * on) : 0.0;
    } else {
        loss += 0.1 * (on * on);
        co += 0.1 * 2.0;
    }
    if (has_prev) {
        loss += 0.1 * (s[CPU_SUR_TT] / (double)numel);
        ct = 0.1 * 2.0 / (double)numel;
    }
    c[0] = (float)(co / count);
    c[1] = (float)(cg / count);
    c[2] = (float)(ct / count);
    return (float)loss;
}

/* Step W: entry q of the padded layout summed over every block, into weight k's real entry. */
static void
write_grads(const sur_ctx *x, int64_t blocks, int32_t hidden, int32_t layers)
{
    const int32_t mh = TM_CMS_DIRECT_MAX_HIDDEN;
    int64_t q = 0; /* ends at cpu_sur_grad_entries(layers) */
    for (int32_t k = 0; k < x->t->weight_grads.count; k++) {
        const int last = k >= 2 * layers;
        const int32_t rows = k % 2 == 1 ? 1 : (last ? 1 : mh);    /* padded [rows][cols] */
        const int32_t cols = k % 2 == 1 ? (last ? 1 : mh) : (k == 0 ? TM_CMS_DIRECT_IN : mh);
        const int32_t h_rows = rows == 1 ? 1 : hidden;
        const int32_t h_cols = cols == mh ? hidden : cols;
        float *out = x->t->weight_grads.tensors[k].data;
        for (int32_t r = 0; r < h_rows; r++) {
            for (int32_t c = 0; c < h_cols; c++) {
                double sum = 0.0;
                for (int64_t b = 0; b < blocks; b++) {
                    sum += x->parts[b * x->stride + q + (int64_t)r * cols + c];
                }
                out[r * h_cols + c] = (float)sum;
            }
        }
        q += (int64_t)rows * cols;
    }
}

tm_status
cpu_cms_surrogate(const tm_cms_surrogate_tensors *t, const tm_cms_surrogate_args *a,
                  const tm_cms_surrogate_inputs *in, const tm_exec *exec)
{
    const int32_t count = t->targets.count;
    if (count == 0) {
        for (int32_t k = 0; k < t->weight_grads.count; k++) {
            float *g = t->weight_grads.tensors[k].data;
            for (int64_t i = 0; i < t->weight_grads.tensors[k].numel; i++) {
                g[i] = 0.0f;
            }
        }
        return TM_OK;
    }
    const int32_t mh = TM_CMS_DIRECT_MAX_HIDDEN;
    const float *w[2 * TM_CMS_MAX_LAYERS + 2];
    for (int32_t k = 0; k < t->weights.count; k++) { /* validated: 2 L + 2 */
        w[k] = t->weights.tensors[k].data;
    }
    tm_cms_direct_net net;
    tm_cms_direct_fill(&net, w, a->hidden, a->layers, 0, 1);
    float w_hid_t[TM_CMS_MAX_LAYERS - 1][TM_CMS_DIRECT_MAX_HIDDEN][TM_CMS_DIRECT_MAX_HIDDEN];
    for (int32_t l = 0; l + 1 < a->layers; l++) {
        for (int32_t j = 0; j < mh; j++) {
            for (int32_t k = 0; k < mh; k++) {
                w_hid_t[l][k][j] = net.w_hid[l][j][k];
            }
        }
    }
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
    float *coefs = (float *)(x.parts + blocks * x.stride);
    const cpu_cms_kernels *k = cpu_active_kernels()->cms;
    x.fn = k->sur_norms;
    cpu_for_each_block(&t->targets, exec, sur_segment, &x);
    float *losses = in->losses.data;
    int64_t first = 0;
    for (int32_t i = 0; i < count; i++) {
        const int64_t numel = t->targets.tensors[i].numel;
        const int64_t nb = cpu_blocks_of(numel);
        double s[CPU_SUR_NORM_PARTS] = {0.0};
        for (int64_t b = first; b < first + nb; b++) {
            for (int q = 0; q < CPU_SUR_NORM_PARTS; q++) {
                s[q] += x.parts[b * x.stride + q];
            }
        }
        const int has_prev = a->has_prev != NULL && a->has_prev[i] != 0;
        losses[i] = loss_and_coefs(s, numel, has_prev, count, coefs + 3 * i);
        first += nb;
    }
    x.coefs = coefs;
    x.fn = k->sur_grads;
    cpu_for_each_block(&t->targets, exec, sur_segment, &x);
    write_grads(&x, blocks, a->hidden, a->layers);
    return TM_OK;
}
