/*
 * cms.cu -- the element passes of the CMS update on CUDA (tm_cms_step; the pass structure and
 * the scratch layout are in cms.cuh and cms_finish.cu, the element math in tm_cms_math.h,
 * shared with cpu/cpu_cms_loops_impl.h, so both backends compute the same bits per element).
 *
 * Thread -> data: TM_CMS_SPLIT blocks per chunk of TM_CHUNK elements of one tensor
 * (multi_tensor.cuh), each one slice of it (cms_locate); TM_CMS_BLOCK threads, thread t takes
 * elements t, t + TM_CMS_BLOCK, ... of the slice (coalesced). Levels are walked one after
 * another inside the block; a level's partial sums are reduced over the block in a fixed tree
 * (cms_block_sum) and stored by thread 0 in the slice's own record: no atomics, the same bits
 * on every run. The DirectUpdateMLP's weights are copied into shared memory, padded
 * (tm_cms_direct_net, 12.3 KB), once per block; each thread evaluates the network for its element
 * with fully unrolled loops, so the activations live in registers. All math in float32 with
 * explicit roundings (no FMA contraction: tm_fmul / tm_fadd), sums in double.
 * A nonzero skip[0] makes every block return at once.
 */
#include "cms.cuh"

/* ---------------------------------------------------------------- LEGACY stats (pass S) ---- */

/* Sums of one firing level over this thread's elements: [sum (m - km), sum (m - km)^2, sum m^2,
 * the same for g^ with kg], km = m[0], kg = g^[0] of the tensor (tm_cms_stats). */
static __device__ void
cms_stats_level(const cms_meta &meta, const cms_params &p, int32_t s, int64_t start, int32_t len,
                int l, double (&v)[TM_CMS_LEGACY_PARTS - 1])
{
    const float *m = cms_state(meta, CMS_ROLE_M, l, s);
    const float *acc = cms_state(meta, CMS_ROLE_ACC, l, s);
    const float scale = p.grad_scale != NULL ? p.grad_scale[0] : 1.0f;
    const float div = cms_level_div(p.c, l);
    const double km = m[0];
    const double kg = cms_level_grad(meta, s, 0, scale, acc[0], div);
    for (int32_t k = threadIdx.x; k < len; k += blockDim.x) {
        const int64_t i = start + k;
        const double x = m[i];
        const double g = cms_level_grad(meta, s, i, scale, acc[i], div);
        v[0] += x - km;
        v[1] += (x - km) * (x - km);
        v[2] += x * x;
        v[3] += g - kg;
        v[4] += (g - kg) * (g - kg);
        v[5] += g * g;
    }
}

__global__ void __launch_bounds__(TM_CMS_BLOCK)
cms_stats_kernel(const __grid_constant__ cms_meta meta, const __grid_constant__ cms_params p)
{
    if (cms_skipped(p)) {
        return;
    }
    int32_t s;
    int32_t len;
    int64_t start;
    cms_locate(meta, &s, &start, &len);
    for (int l = 0; l < p.c.levels; l++) {
        if (!(p.c.fires >> l & 1u)) {
            continue; /* uniform across the block */
        }
        double v[TM_CMS_LEGACY_PARTS - 1] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
        cms_stats_level(meta, p, s, start, len, l, v);
        cms_block_sum(v);
        double *rec = cms_record(p, l);
        for (int q = 0; q < TM_CMS_LEGACY_PARTS - 1 && threadIdx.x == 0; q++) {
            rec[q] = v[q];
        }
    }
}

/* ---------------------------------------------------------------- update (pass A) ---- */

/* Element i of firing level l: g^, e, v, then m' (DIRECT: 0.9 m + 0.1 delta, delta parked in
 * A_l for the apply pass; LEGACY: a m + b g^, A_l = 0) into m_l. v += [g^2, m'^2, delta^2]. */
static __device__ __forceinline__ void
cms_update_elem(const cms_meta &meta, const cms_params &p, const tm_cms_direct_net *net,
                const tm_cms_level_out &lo, int32_t s, int64_t i, int l, float div, float scale,
                double (&v)[TM_CMS_DIRECT_PARTS])
{
    float *m = cms_state(meta, CMS_ROLE_M, l, s) + i;
    float *acc = cms_state(meta, CMS_ROLE_ACC, l, s) + i;
    const float gh = cms_level_grad(meta, s, i, scale, *acc, div);
    float *ema = cms_state(meta, CMS_ROLE_EMA, l, s); /* NULL: not kept */
    float *vsq = cms_state(meta, CMS_ROLE_VSQ, l, s);
    tm_cms_ema_elem(ema != NULL ? ema + i : NULL, vsq != NULL ? vsq + i : NULL, gh, &p.c, l);
    float mp;
    float d = 0.0f;
    if (p.legacy) {
        mp = tm_fadd(tm_fmul(lo.a, *m), tm_fmul(lo.b, gh));
    } else {
        d = tm_cms_direct_delta(net, gh, *m);
        mp = tm_fadd(tm_fmul(p.c.mom_keep, *m), tm_fmul(p.c.mom_take, d));
    }
    *m = mp;
    *acc = d;
    v[0] += (double)gh * (double)gh;
    v[1] += (double)mp * (double)mp;
    v[2] += (double)d * (double)d;
}

/* Record of level l: DIRECT [g^2, m'^2, delta^2]; LEGACY only its last slot, m'^2. */
static __device__ __forceinline__ void
cms_store_parts(const cms_params &p, int l, const double (&v)[TM_CMS_DIRECT_PARTS])
{
    double *rec = cms_record(p, l);
    if (threadIdx.x != 0) {
        return;
    }
    if (p.legacy) {
        rec[TM_CMS_LEGACY_PARTS - 1] = v[1];
        return;
    }
    for (int q = 0; q < TM_CMS_DIRECT_PARTS; q++) {
        rec[q] = v[q];
    }
}

__global__ void __launch_bounds__(TM_CMS_BLOCK)
cms_update_kernel(const __grid_constant__ cms_meta meta, const __grid_constant__ cms_params p)
{
    __shared__ tm_cms_direct_net s_net;
    if (cms_skipped(p)) {
        return;
    }
    int32_t s;
    int32_t len;
    int64_t start;
    cms_locate(meta, &s, &start, &len);
    const float scale = p.grad_scale != NULL ? p.grad_scale[0] : 1.0f;
    if (!p.legacy) {
        tm_cms_direct_fill(&s_net, p.w, p.hidden, p.layers, threadIdx.x, blockDim.x);
        __syncthreads();
    }
    for (int l = 0; l < p.c.levels; l++) {
        float *acc = cms_state(meta, CMS_ROLE_ACC, l, s) + start;
        if (!(p.c.fires >> l & 1u)) {
            for (int32_t k = threadIdx.x; k < len; k += blockDim.x) {
                acc[k] = cms_acc_grad(meta, s, start + k, scale, acc[k]);
            }
            continue;
        }
        tm_cms_level_out lo = {}; /* LEGACY's (a, b), from cms_coeffs_kernel */
        if (p.legacy) {
            lo = p.lv[(int64_t)meta.index[s] * p.c.levels + l];
        }
        const float div = cms_level_div(p.c, l);
        double v[TM_CMS_DIRECT_PARTS] = {0.0, 0.0, 0.0};
        for (int32_t k = threadIdx.x; k < len; k += blockDim.x) {
            cms_update_elem(meta, p, &s_net, lo, s, start + k, l, div, scale, v);
        }
        cms_block_sum(v);
        cms_store_parts(p, l, v);
    }
}

/* ---------------------------------------------------------------- apply (pass B) ---- */

/* Element i: m_l *= scale and u = sum of the ok contributions for every fired level, then
 * p = p + (-lr) * round(u / sqrt(n) + round(wd p)) as one FMA (torch's add_ with alpha, alpha
 * rounded to p's dtype as torch does on the CPU). */
static __device__ __forceinline__ void
cms_apply_elem(const cms_meta &meta, const cms_params &p, const tm_cms_level_out *lv,
               const tm_cms_tensor_out &tv, int32_t s, int64_t i, float alpha, double alpha_wide)
{
    float u = 0.0f;
    for (int l = 0; l < p.c.levels; l++) {
        if (!lv[l].fired) {
            continue;
        }
        float *m = cms_state(meta, CMS_ROLE_M, l, s) + i;
        float *acc = cms_state(meta, CMS_ROLE_ACC, l, s) + i;
        const float mc = tm_fmul(*m, lv[l].scale);
        const float c = p.legacy ? tm_fmul(mc, lv[l].omd) : *acc;
        *m = mc;
        if (!p.legacy) {
            *acc = 0.0f; /* delta's parking place: the reference left A_l = 0 */
        }
        u = tm_fadd(u, lv[l].ok ? c : 0.0f); /* u + 0 == u: u starts at +0 */
    }
    if (!tv.apply) {
        return;
    }
    const int dt = meta.dtype[s];
    void *pp = meta.ptr[CMS_IDX_PARAM][s];
    float v = tm_fdiv(u, tv.n_ok > 1 ? tv.sqrt_n : 1.0f);
    if (dt == TM_FLOAT64) { /* in double, the float32 rate widened (tm_cms_apply_wide) */
        double *pd = (double *)pp;
        pd[i] = tm_cms_apply_wide(pd[i], v, alpha_wide, p.c.weight_decay_wide,
                                  p.c.weight_decay > 0.0f);
        return;
    }
    const float pv = cms_load(pp, i, dt);
    if (p.c.weight_decay > 0.0f) {
        v = tm_fadd(v, cms_round(tm_fmul(p.c.weight_decay, pv), dt));
    }
    const float r = tm_fma(alpha, cms_round(v, dt), pv);
    if (dt == TM_FLOAT32) {
        ((float *)pp)[i] = r;
    } else if (dt == TM_BFLOAT16) {
        ((__nv_bfloat16 *)pp)[i] = __float2bfloat16_rn(r);
    } else {
        ((__half *)pp)[i] = __float2half_rn(r);
    }
}

__global__ void __launch_bounds__(TM_CMS_BLOCK)
cms_apply_kernel(const __grid_constant__ cms_meta meta, const __grid_constant__ cms_params p)
{
    __shared__ tm_cms_level_out s_lv[TM_CMS_MAX_LEVELS];
    __shared__ tm_cms_tensor_out s_tv;
    if (cms_skipped(p)) {
        return;
    }
    int32_t s;
    int32_t len;
    int64_t start;
    cms_locate(meta, &s, &start, &len);
    const int64_t i = meta.index[s];
    if (threadIdx.x < p.c.levels) {
        s_lv[threadIdx.x] = p.lv[i * p.c.levels + threadIdx.x];
    }
    if (threadIdx.x == 0) {
        s_tv = p.tv[i];
    }
    __syncthreads();
    const float alpha = cms_round(-p.lr[meta.group[s]], meta.dtype[s]);
    const double alpha_wide = -(double)p.lr[meta.group[s]];
    for (int32_t k = threadIdx.x; k < len; k += blockDim.x) {
        cms_apply_elem(meta, p, s_lv, s_tv, s, start + k, alpha, alpha_wide);
    }
}

/* ---------------------------------------------------------------- launchers ---- */

/* Every element pass runs on the same grid: one block per (chunk, slice of the chunk). */
template <typename Kernel>
static tm_status
launch_element_pass(Kernel kernel, const cms_meta &meta, const cms_params &p, cudaStream_t stream)
{
    const dim3 grid(meta.t.num_chunks, TM_CMS_SPLIT);
    kernel<<<grid, TM_CMS_BLOCK, 0, stream>>>(meta, p);
    TM_CUDA_CHECK(cudaGetLastError());
    return TM_OK;
}

tm_status
cms_launch_stats(const cms_meta &meta, const cms_params &p, cudaStream_t stream)
{
    return launch_element_pass(cms_stats_kernel, meta, p, stream);
}

tm_status
cms_launch_update(const cms_meta &meta, const cms_params &p, cudaStream_t stream)
{
    return launch_element_pass(cms_update_kernel, meta, p, stream);
}

tm_status
cms_launch_apply(const cms_meta &meta, const cms_params &p, cudaStream_t stream)
{
    return launch_element_pass(cms_apply_kernel, meta, p, stream);
}
