/*
 * dno.cu -- the DeepNestedOptimizer's control step on the device (tm_dno_control), so that no
 * value of a step visits the host: the loss guard, the loss EMA, the controller MLP over the G
 * group rows, lr = base_lr * mu, the clip coefficient and the non-finite-norm skip flag, which
 * tm_adamw_step then reads as grad_scale and skip. Spec deep_nested_optimizer.md sections 3-6
 * and 8; the order and the element math are cpu/cpu_dno.c's and tm_math.h's (same bits).
 *
 * dno_control_kernel: one block, one launch. Threads map to hidden units (blockDim = H rounded up
 * to a warp, <= TM_DNO_MAX_HIDDEN); each unit's dot product is summed in index order in double by
 * its thread (tm_dno_unit), layer by layer through two shared-memory activation rows, one group
 * row after another. Thread 0 does the scalar work (ema, mu, lr, coef, skip). No atomics; the
 * result does not depend on the block size. Work is tiny (G * (L-1) * H^2 MACs, ~5K for the
 * TitanMAC controller), so latency, not bandwidth, is what it costs.
 */
#include "cuda_ops.h"
#include "cuda_common.cuh"
#include "tm_nvtx.cuh"

/* Everything by value: 2 * (TM_DNO_MAX_LAYERS + 1) weight pointers fit the 4 KB parameter space
 * of any driver. */
struct dno_params {
    const float *group_grad, *group_param, *total_grad, *depths, *loss;
    float *mu, *ema, *lr, *coef, *skip;
    float *previous; /* NULL when not wanted */
    const float *w[2 * (TM_DNO_MAX_LAYERS + 1)];
    tm_dno_consts c;
    double base_lr;
    int32_t num_groups, hidden, layers;
    int32_t update_controller, first_step, check_loss, clip;
};
static_assert(sizeof(dno_params) <= 4096, "dno_params must fit the 4 KB kernel parameter space");

/* The controller's output r for group g (valid in thread 0). Every thread of the block calls it;
 * it leaves the activation rows free for the next call. */
static __device__ float
dno_forward(const dno_params &p, int32_t g, float (*act)[TM_DNO_MAX_HIDDEN])
{
    const int32_t h = p.hidden;
    const float x[3] = {tm_dno_clean(p.group_grad[g]), tm_dno_clean(p.group_param[g]),
                        tm_dno_clean(p.depths[g])};
    for (int32_t j = threadIdx.x; j < h; j += blockDim.x) {
        act[0][j] = tm_dno_unit(p.w[0] + (int64_t)j * 3, p.w[1][j], x, 3, 1);
    }
    __syncthreads();
    int cur = 0;
    for (int32_t l = 1; l < p.layers; l++) {
        const float *w = p.w[2 * l];
        const float *b = p.w[2 * l + 1];
        for (int32_t j = threadIdx.x; j < h; j += blockDim.x) {
            act[cur ^ 1][j] = tm_dno_unit(w + (int64_t)j * h, b[j], act[cur], h, 1);
        }
        __syncthreads(); /* row cur ^ 1 complete; row cur is free to be overwritten next */
        cur ^= 1;
    }
    float r = 0.0f;
    if (threadIdx.x == 0) {
        r = tm_dno_unit(p.w[2 * p.layers], p.w[2 * p.layers + 1][0], act[cur], h, 0);
    }
    __syncthreads(); /* the next group's first layer overwrites row 0 */
    return r;
}

/* Spec 4: one non-finite depth turns every multiplier into 1.0. Same answer in every thread. */
static __device__ void
dno_controller(const dno_params &p, float (*act)[TM_DNO_MAX_HIDDEN])
{
    bool any_bad = false;
    for (int32_t g = 0; g < p.num_groups; g++) {
        any_bad |= !isfinite(p.depths[g]);
    }
    for (int32_t g = 0; g < p.num_groups; g++) {
        const float mu = any_bad ? 1.0f : tm_dno_mu_elem(dno_forward(p, g, act), &p.c);
        if (threadIdx.x == 0) {
            p.mu[g] = mu;
        }
    }
}

__global__ void __launch_bounds__(TM_DNO_MAX_HIDDEN)
dno_control_kernel(const __grid_constant__ dno_params p)
{
    __shared__ float act[2][TM_DNO_MAX_HIDDEN];
    const float loss = p.loss[0];
    const bool run = !p.check_loss || isfinite(loss); /* uniform: every thread reads loss */
    if (p.previous != NULL && threadIdx.x == 0) { /* only thread 0 writes these, below */
        const int64_t g_count = p.num_groups; /* 2G + 4 passes INT32_MAX for G near 2^30 */
        for (int64_t g = 0; g < g_count; g++) {
            p.previous[g] = p.mu[g];
            p.previous[g_count + 2 + g] = p.lr[g];
        }
        p.previous[g_count] = p.ema[0];
        p.previous[g_count + 1] = p.ema[1];
        p.previous[2 * g_count + 2] = p.coef[0];
        p.previous[2 * g_count + 3] = p.skip[0];
    }
    if (run && threadIdx.x == 0) {
        for (int k = 0; k < 2; k++) {
            p.ema[k] = p.first_step ? loss : tm_dno_ema_elem(p.ema[k], loss, &p.c);
        }
    }
    if (run && p.update_controller) {
        dno_controller(p, act);
    }
    if (threadIdx.x != 0) {
        return;
    }
    const float total = p.total_grad[0];
    const bool clip = run && p.clip;
    for (int32_t g = 0; g < p.num_groups; g++) {
        p.lr[g] = tm_dno_lr_elem(p.base_lr, p.mu[g]); /* thread 0 wrote mu: visible to itself */
    }
    p.coef[0] = clip ? tm_clip_coef_elem(total, p.c.max_norm) : 1.0f;
    p.skip[0] = (!run || (clip && !isfinite(total))) ? 1.0f : 0.0f;
}

tm_status
cuda_dno_control(const tm_dno_control_tensors *t, const tm_dno_control_args *a, const tm_exec *exec)
{
    TM_NVTX_RANGE("cuda_dno_control");
    cuda_device_guard guard;
    TM_TRY(guard.enter(t->mu.device_id));
    dno_params p;
    p.group_grad = (const float *)t->group_grad.data;
    p.group_param = (const float *)t->group_param.data;
    p.total_grad = (const float *)t->total_grad.data;
    p.depths = (const float *)t->depths.data;
    p.loss = (const float *)t->loss.data;
    p.mu = (float *)t->mu.data;
    p.ema = (float *)t->ema.data;
    p.lr = (float *)t->lr.data;
    p.coef = (float *)t->coef.data;
    p.skip = (float *)t->skip.data;
    p.previous = (float *)t->previous.data; /* NULL when not given (validated) */
    for (int32_t i = 0; i < t->weights.count; i++) { /* 2 * (layers + 1), validated */
        p.w[i] = (const float *)t->weights.tensors[i].data;
    }
    p.c = tm_dno_consts_make(a->ema_beta, a->mu_min, a->mu_max, a->max_grad_norm);
    p.base_lr = a->base_lr;
    p.num_groups = a->num_groups;
    p.hidden = a->hidden;
    p.layers = a->layers;
    p.update_controller = a->update_controller != 0;
    p.first_step = a->first_step != 0;
    p.check_loss = a->check_loss != 0;
    p.clip = a->max_grad_norm > 0.0;
    const unsigned int threads = (unsigned int)((a->hidden + 31) / 32 * 32);
    dno_control_kernel<<<1, threads, 0, cuda_stream_of(exec)>>>(p);
    TM_CUDA_CHECK(cudaGetLastError());
    return TM_OK;
}
