/*
 * cpu_dno.c -- the DeepNestedOptimizer's control step on the CPU (tm_dno_control): a plain loop,
 * a few scalars and G evaluations of a small MLP, in the order of spec deep_nested_optimizer.md
 * section 5 steps 3 and 5-8:
 *   non-finite loss (check_loss): skip = 1, coef = 1, lr = base_lr * mu, mu and ema unchanged
 *   ema = loss on the first step, else (1 - beta) * ema + beta * loss
 *   controller steps: mu[g] = controller(clean(grad norm, param norm, depth)), all 1.0 when a
 *     depth is non-finite (section 4 steps 1-5; section 3 already made non-finite norms 1.0)
 *   lr = base_lr * mu; clipping: coef = min(1, max / (total + 1e-6)), skip = !isfinite(total)
 * The element math is tm_math.h's, shared with cuda/dno.cu, which gives the same bits. Two rows
 * of at most TM_DNO_MAX_HIDDEN activations live on the stack (8 KB): the library allocates
 * nothing, and the op needs no scratch.
 */
#include "cpu_ops.h"

/* r = the controller's output for one cleaned input row x[3] (validated shapes, see titanmac.h:
 * weights W0 [H,3], b0, (W_i [H,H], b_i) x (L-1), W_out [1,H], b_out). */
static float
controller_row(const tm_tensor_list *weights, int32_t hidden, int32_t layers, const float x[3])
{
    float act[2][TM_DNO_MAX_HIDDEN];
    const float *w = weights->tensors[0].data;
    const float *b = weights->tensors[1].data;
    for (int32_t j = 0; j < hidden; j++) {
        act[0][j] = tm_dno_unit(w + (int64_t)j * 3, b[j], x, 3, 1);
    }
    int cur = 0;
    for (int32_t l = 1; l < layers; l++) {
        w = weights->tensors[2 * l].data;
        b = weights->tensors[2 * l + 1].data;
        for (int32_t j = 0; j < hidden; j++) {
            act[cur ^ 1][j] = tm_dno_unit(w + (int64_t)j * hidden, b[j], act[cur], hidden, 1);
        }
        cur ^= 1;
    }
    w = weights->tensors[2 * layers].data;
    b = weights->tensors[2 * layers + 1].data;
    return tm_dno_unit(w, b[0], act[cur], hidden, 0);
}

/* Spec 4: one bad (non-finite) depth turns every multiplier into 1.0. */
static void
run_controller(const tm_dno_control_tensors *t, const tm_dno_control_args *a,
               const tm_dno_consts *c)
{
    const float *gg = t->group_grad.data;
    const float *gp = t->group_param.data;
    const float *depth = t->depths.data;
    float *mu = t->mu.data;
    int any_bad = 0;
    for (int32_t g = 0; g < a->num_groups; g++) {
        any_bad |= !isfinite(depth[g]);
    }
    for (int32_t g = 0; g < a->num_groups; g++) {
        const float x[3] = {tm_dno_clean(gg[g]), tm_dno_clean(gp[g]), tm_dno_clean(depth[g])};
        mu[g] = any_bad ? 1.0f
                        : tm_dno_mu_elem(controller_row(&t->weights, a->hidden, a->layers, x), c);
    }
}

/* The optional undo record: mu, ema, lr, coef and skip before this call writes them. */
static void
save_previous(const tm_dno_control_tensors *t, int32_t num_groups)
{
    if (t->previous.data == NULL) { /* not given (validated: given means numel 2G + 4) */
        return;
    }
    float *prev = t->previous.data;
    const float *mu = t->mu.data;
    const float *ema = t->ema.data;
    const float *lr = t->lr.data;
    const int64_t n = num_groups; /* 2G + 4 passes INT32_MAX for G near 2^30 */
    for (int64_t g = 0; g < n; g++) {
        prev[g] = mu[g];
        prev[n + 2 + g] = lr[g];
    }
    prev[n] = ema[0];
    prev[n + 1] = ema[1];
    prev[2 * n + 2] = *(const float *)t->coef.data;
    prev[2 * n + 3] = *(const float *)t->skip.data;
}

tm_status
cpu_dno_control(const tm_dno_control_tensors *t, const tm_dno_control_args *a, const tm_exec *exec)
{
    const tm_dno_consts c = tm_dno_consts_make(a->ema_beta, a->mu_min, a->mu_max, a->max_grad_norm);
    const float loss = *(const float *)t->loss.data;
    const float *mu = t->mu.data;
    float *lr = t->lr.data;
    float coef = 1.0f;
    float skip = 1.0f;
    (void)exec;
    save_previous(t, a->num_groups);
    if (!a->check_loss || isfinite(loss)) {
        float *ema = t->ema.data;
        for (int k = 0; k < 2; k++) {
            ema[k] = a->first_step ? loss : tm_dno_ema_elem(ema[k], loss, &c);
        }
        if (a->update_controller) {
            run_controller(t, a, &c);
        }
        const float total = *(const float *)t->total_grad.data;
        int clip = a->max_grad_norm > 0.0;
        coef = clip ? tm_clip_coef_elem(total, c.max_norm) : 1.0f;
        skip = (clip && !isfinite(total)) ? 1.0f : 0.0f;
    }
    for (int32_t g = 0; g < a->num_groups; g++) {
        lr[g] = tm_dno_lr_elem(a->base_lr, mu[g]);
    }
    *(float *)t->coef.data = coef;
    *(float *)t->skip.data = skip;
    return TM_OK;
}
