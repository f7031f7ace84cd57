/*
 * cms_finish.cu -- the CMS update on CUDA (tm_cms_step): the per-tensor kernels, the walk over
 * the tensor list and the entry points. Passes per batch of tensors (one table of cms.cuh), in
 * stream order, so each reads what the previous one wrote and no value visits the host:
 *
 *   LEGACY:  stats (chunks) -> coeffs (tensors) -> update (chunks) -> finish (tensors) -> apply
 *   DIRECT:                                        update (chunks) -> finish (tensors) -> apply
 *
 * Per-tensor kernels give each tensor one warp (TM_CMS_WARPS per block): lane j adds the records
 * of slices j, j + 32, ... in order, then a fixed shuffle tree (deterministic). coeffs: lane 0
 * turns the stats into the legacy network's input and evaluates it (tm_cms_legacy_coeffs, the
 * CPU's code). finish: lane 0 computes the clamp scale and ok flag of each firing level
 * (tm_cms_finish_level), n_ok and the overflow bound (tm_cms_finish_tensor), and adds 1 to the
 * tensor's step count of each firing level; numel-0 tensors are in the tables for that.
 *
 * Scratch (cuda_cms_scratch_bytes): double parts[chunks * TM_CMS_SPLIT][levels][P],
 * tm_cms_level_out [count][levels], tm_cms_tensor_out [count]; every record is written before it
 * is read in the same call, so nothing needs zeroing. Launches per step: 3 (DIRECT) or 5
 * (LEGACY) per batch of 187 tensors (cms_meta::capacity at 32 KB of parameters).
 */
#include "cms.cuh"
#include "cuda_ops.h"

#define TM_CMS_WARPS 4 /* tensors per block of the per-tensor kernels */

/* out[q] (lane 0) = sum of part q < n of level l over records [c0, c1). */
static __device__ void
cms_combine(const cms_params &p, int64_t c0, int64_t c1, int l, int n, double *out)
{
    const int lane = threadIdx.x & 31;
    for (int q = 0; q < n; q++) {
        double v = 0.0;
        for (int64_t c = c0 + lane; c < c1; c += 32) {
            v += p.parts[(c * p.c.levels + l) * p.nparts + q];
        }
        out[q] = warp_reduce(v, cms_add());
    }
}

/* This warp's tensor slot and its record range; false when the warp has no tensor. */
static __device__ bool
cms_warp_tensor(const cms_meta &meta, const cms_params &p, int32_t *s, int64_t *c0, int64_t *c1)
{
    *s = (int32_t)(blockIdx.x * TM_CMS_WARPS + (threadIdx.x >> 5));
    if (*s >= meta.t.count) {
        return false;
    }
    *c0 = (p.chunk_base + (*s > 0 ? meta.t.chunk_end[*s - 1] : 0u)) * TM_CMS_SPLIT;
    *c1 = (p.chunk_base + meta.t.chunk_end[*s]) * TM_CMS_SPLIT;
    return true;
}

__global__ void __launch_bounds__(32 * TM_CMS_WARPS)
cms_coeffs_kernel(const __grid_constant__ cms_meta meta, const __grid_constant__ cms_params p)
{
    int32_t s;
    int64_t c0, c1;
    if (cms_skipped(p) || !cms_warp_tensor(meta, p, &s, &c0, &c1)) {
        return; /* uniform per warp */
    }
    /* The network's input, activations and weight pointers per warp in shared memory: only lane
     * 0 evaluates the network, so per-thread local arrays would reserve them 32 times. */
    __shared__ float s_in[TM_CMS_WARPS][TM_CMS_LEGACY_IN];
    __shared__ float s_act[TM_CMS_WARPS][2 * TM_CMS_LEGACY_MAX_HIDDEN];
    __shared__ const float *s_w[TM_CMS_WARPS][2 * TM_CMS_MAX_LAYERS + 3];
    const int64_t numel = meta.t.numel[s];
    const float scale = p.grad_scale != NULL ? p.grad_scale[0] : 1.0f;
    float *in = s_in[threadIdx.x >> 5];
    float *act = s_act[threadIdx.x >> 5];
    const float **w = s_w[threadIdx.x >> 5];
    if ((threadIdx.x & 31) == 0) {
        tm_cms_context(in + 6, p.context != NULL ? p.context[0] : p.t,
                       p.context != NULL ? p.context[1] : p.base_lr, p.loss[0]);
#pragma unroll
        for (int k = 0; k < 2 * TM_CMS_MAX_LAYERS + 3; k++) {
            w[k] = p.w[k];
        }
    }
    __syncwarp();
    for (int l = 0; l < p.c.levels; l++) {
        double v[TM_CMS_LEGACY_PARTS - 1];
        if (!(p.c.fires >> l & 1u)) {
            continue;
        }
        cms_combine(p, c0, c1, l, TM_CMS_LEGACY_PARTS - 1, v);
        if ((threadIdx.x & 31) == 0) {
            const float *m = cms_state(meta, CMS_ROLE_M, l, s);
            const float *acc = cms_state(meta, CMS_ROLE_ACC, l, s);
            const float km = numel > 0 ? m[0] : 0.0f;
            const float kg =
                numel > 0 ? cms_level_grad(meta, s, 0, scale, acc[0], cms_level_div(p.c, l)) : 0.0f;
            tm_cms_stats(v, km, numel, in);
            tm_cms_stats(v + 3, kg, numel, in + 3);
            tm_cms_legacy_coeffs(&p.lv[(int64_t)meta.index[s] * p.c.levels + l], w, p.hidden,
                                 p.layers, in, act);
        }
        __syncwarp(); /* the next level's shuffles start from a converged warp */
    }
}

__global__ void __launch_bounds__(32 * TM_CMS_WARPS)
cms_finish_kernel(const __grid_constant__ cms_meta meta, const __grid_constant__ cms_params p)
{
    int32_t s;
    int64_t c0, c1;
    if (cms_skipped(p) || !cms_warp_tensor(meta, p, &s, &c0, &c1)) {
        return; /* uniform per warp */
    }
    const bool lead = (threadIdx.x & 31) == 0;
    const int64_t i = meta.index[s];
    float *steps = (float *)meta.ptr[CMS_IDX_STEPS][s];
    double bound = 0.0;
    int32_t n_ok = 0;
    for (int l = 0; l < p.c.levels; l++) {
        tm_cms_level_out *o = &p.lv[i * p.c.levels + l];
        const bool fires = p.c.fires >> l & 1u;
        double v[TM_CMS_LEGACY_PARTS];
        if (fires) {
            cms_combine(p, c0, c1, l, p.nparts, v);
        }
        if (!lead) {
            continue;
        }
        if (!p.legacy) {
            o->a = o->b = o->omd = 0.0f;
        }
        o->fired = o->ok = 0;
        if (fires) {
            bound += tm_cms_finish_level(o, v, p.legacy, meta.t.numel[s], p.c.clamp_ratio);
            n_ok += o->ok;
            steps[l] = steps[l] + 1.0f;
        }
    }
    if (lead) {
        tm_cms_finish_tensor(&p.tv[i], n_ok, bound);
    }
}

/* ---------------------------------------------------------------- the walk ---- */

/* The op as multi_tensor_apply walks it: every tensor (numel 0 too: its steps count). */
struct cms_walk {
    static constexpr bool keep_empty = true;
    const tm_cms_tensors *t;
    const tm_cms_args *a;
    cms_params params;
    cudaStream_t stream;

    bool include(int32_t) const { return true; }
    int64_t numel(int32_t i) const { return t->params.tensors[i].numel; }
    template <typename Meta> bool fits(const Meta &, int32_t) const { return true; }
    template <typename Meta> void clear(Meta &) const {}

    template <typename Meta>
    void
    fill(Meta &m, int32_t slot, int32_t i) const
    {
        const tm_tensor_list *roles[4] = {t->momentum, t->accumulated, t->ema, t->v_sq};
        m.ptr[CMS_IDX_PARAM][slot] = t->params.tensors[i].data;
        m.ptr[CMS_IDX_GRAD][slot] = t->grads.tensors[i].data;
        for (int r = 0; r < 4; r++) {
            for (int l = 0; l < TM_CMS_MAX_LEVELS; l++) {
                const bool kept = l < a->levels && roles[r][l].count > 0; /* ema, v_sq: optional */
                m.ptr[cms_idx(r, l)][slot] = kept ? roles[r][l].tensors[i].data : NULL;
            }
        }
        m.ptr[CMS_IDX_STEPS][slot] = t->step_counts.tensors[i].data;
        m.index[slot] = i;
        m.group[slot] = a->group_of != NULL ? a->group_of[i] : 0;
        m.dtype[slot] = (uint8_t)t->params.tensors[i].dtype;
    }

    template <typename Meta>
    tm_status
    launch(const Meta &m, int64_t chunk_base) const
    {
        cms_params p = params;
        p.chunk_base = chunk_base;
        const unsigned int blocks = (unsigned int)((m.t.count + TM_CMS_WARPS - 1) / TM_CMS_WARPS);
        const bool chunks = m.t.num_chunks > 0;
        if (p.legacy) {
            if (chunks) {
                TM_TRY(cms_launch_stats(m, p, stream));
            }
            cms_coeffs_kernel<<<blocks, 32 * TM_CMS_WARPS, 0, stream>>>(m, p);
            TM_CUDA_CHECK(cudaGetLastError());
        }
        if (chunks) {
            TM_TRY(cms_launch_update(m, p, stream));
        }
        cms_finish_kernel<<<blocks, 32 * TM_CMS_WARPS, 0, stream>>>(m, p);
        TM_CUDA_CHECK(cudaGetLastError());
        return chunks ? cms_launch_apply(m, p, stream) : TM_OK;
    }
};

/* ---------------------------------------------------------------- entry points ---- */

size_t
cuda_cms_scratch_bytes(const tm_tensor_list *params, int32_t levels, tm_cms_net net)
{
    if (params == NULL || params->count <= 0 || params->tensors == NULL) {
        return 0;
    }
    const size_t slices = (size_t)cuda_list_chunks(params) * TM_CMS_SPLIT;
    return tm_cms_scratch_layout_bytes(slices, (size_t)params->count, levels, net);
}

tm_status
cuda_cms_step(const tm_cms_tensors *t, const tm_cms_args *a, const tm_cms_inputs *in,
              const tm_exec *exec)
{
    if (t->params.count == 0) {
        return TM_OK;
    }
    cuda_device_guard guard;
    TM_TRY(guard.enter(t->params.tensors[0].device_id));
    cms_walk walk;
    walk.t = t;
    walk.a = a;
    walk.stream = cuda_stream_of(exec);
    cms_params &p = walk.params;
    p.c = tm_cms_consts_make(a);
    p.lr = (const float *)in->lr.data;
    p.grad_scale = (const float *)in->grad_scale.data; /* NULL when not given */
    p.skip = (const float *)in->skip.data;
    p.loss = (const float *)in->loss.data;
    p.context = (const double *)in->context.data; /* NULL when not given */
    for (int32_t i = 0; i < 2 * TM_CMS_MAX_LAYERS + 3; i++) {
        p.w[i] = i < t->weights.count ? (const float *)t->weights.tensors[i].data : NULL;
    }
    p.nparts = tm_cms_parts_of(a->net);
    p.parts = (double *)exec->scratch;
    const int64_t slices = cuda_list_chunks(&t->params) * TM_CMS_SPLIT;
    p.lv = (tm_cms_level_out *)(p.parts + slices * a->levels * p.nparts);
    p.tv = (tm_cms_tensor_out *)(p.lv + (int64_t)t->params.count * a->levels);
    p.chunk_base = 0;
    p.t = a->t;
    p.base_lr = a->base_lr;
    p.legacy = a->net == TM_CMS_LEGACY;
    p.hidden = a->hidden;
    p.layers = a->layers;
    return multi_tensor_apply<cms_meta>(walk, t->params.count);
}
