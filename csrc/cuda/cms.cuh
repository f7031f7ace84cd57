/*
 * cms.cuh -- what the two files of the CMS update on CUDA share (tm_cms_step; spec
 * deep_nested_optimizer.md 7.2 Phase 2): the launch table of a batch of tensors, the per-call
 * kernel parameters, and the launchers of the element passes (cms.cu) that the driver
 * (cms_finish.cu) calls per batch:
 *
 *   [LEGACY] cms_stats_kernel    per (chunk, firing level): shifted sums of m_l and g^_l
 *   [LEGACY] cms_coeffs_kernel   per tensor (one warp): stats -> network -> (a, b, 1 - d)
 *            cms_update_kernel   per chunk: accumulate / g^, e, v, m' (+ delta parked in A_l)
 *            cms_finish_kernel   per tensor (one warp): clamp, ok, n_ok, bound, step counts
 *            cms_apply_kernel    per chunk: m_l *= scale, u, p -= lr (u / sqrt(n) + wd p)
 *
 * Element kernels run TM_CMS_SPLIT blocks per chunk of TM_CHUNK elements (block (b, y) takes
 * slice y of chunk b, possibly empty). Records: parts[(global slice) * levels + level][P]
 * (P = TM_CMS_DIRECT_PARTS or TM_CMS_LEGACY_PARTS), global slice = (chunk_base + b) *
 * TM_CMS_SPLIT + y, each written by exactly one block (multi_tensor.cuh numbers chunks across
 * launches in list order, so chunk_base + b is the chunk's index in the whole call).
 */
#ifndef TM_CMS_CUH
#define TM_CMS_CUH

#include "multi_tensor.cuh"
#include "tm_cms_finish.h"

#define TM_CMS_BLOCK 256 /* threads of the element kernels: the MLP needs ~75 registers */
#define TM_CMS_SPLIT 8   /* blocks per chunk (grid.y): 8,192 elements per block, so a 3M-element
                            model gives ~400 blocks of MLP work, not the ~50 of whole chunks */
static_assert(TM_CHUNK % TM_CMS_SPLIT == 0, "equal slices of a chunk");

/* Indices into cms_meta::ptr: param, grad, the 4 roles x TM_CMS_MAX_LEVELS levels, steps. */
enum { CMS_IDX_PARAM = 0, CMS_IDX_GRAD = 1, CMS_IDX_STATE = 2 };
enum { CMS_ROLE_M = 0, CMS_ROLE_ACC = 1, CMS_ROLE_EMA = 2, CMS_ROLE_VSQ = 3 };
constexpr int CMS_IDX_STEPS = CMS_IDX_STATE + 4 * TM_CMS_MAX_LEVELS;
constexpr int CMS_PTRS = CMS_IDX_STEPS + 1;

static __host__ __device__ __forceinline__ int
cms_idx(int role, int level)
{
    return CMS_IDX_STATE + role * TM_CMS_MAX_LEVELS + level;
}

/* Everything of a call that is not per tensor; by value (__grid_constant__). */
struct cms_params {
    tm_cms_consts c;
    const float *lr;         /* [G] */
    const float *grad_scale; /* [1] or NULL (= 1) */
    const float *skip;       /* [1] or NULL */
    const float *loss;       /* [1]; LEGACY only */
    const double *context;   /* [2] (t, base_lr) instead of t and base_lr below, or NULL */
    const float *w[2 * TM_CMS_MAX_LAYERS + 3];
    double *parts;           /* scratch records */
    tm_cms_level_out *lv;    /* scratch [count][levels] */
    tm_cms_tensor_out *tv;   /* scratch [count] */
    int64_t chunk_base;      /* chunks of the earlier launches of this call */
    double t, base_lr;
    int32_t legacy, hidden, layers, nparts;
};

struct cms_meta {
    static constexpr int capacity =
        cuda_meta_capacity(CMS_PTRS * sizeof(void *) + 2 * sizeof(int32_t) + 1, sizeof(cms_params));
    void *ptr[CMS_PTRS][capacity];
    tensor_table<capacity> t;
    int32_t index[capacity]; /* the tensor's position in the call's lists */
    int32_t group[capacity];
    uint8_t dtype[capacity]; /* params[i].dtype (= grads[i].dtype) */
};
static_assert(sizeof(cms_meta) + sizeof(cms_params) <= TM_KERNEL_PARAM_BYTES, "params");

static __device__ __forceinline__ bool
cms_skipped(const cms_params &p)
{
    return p.skip != NULL && p.skip[0] != 0.0f;
}

/* x rounded to dtype and widened back (the identity for float32). */
static __device__ __forceinline__ float
cms_round(float x, int dtype)
{
    if (dtype == TM_BFLOAT16) {
        return __bfloat162float(__float2bfloat16_rn(x));
    }
    return dtype == TM_FLOAT16 ? __half2float(__float2half_rn(x)) : x;
}

/* Element i as a float (a float64 one rounded: the float32 view torch's .float() takes). */
static __device__ __forceinline__ float
cms_load(const void *x, int64_t i, int dtype)
{
    if (dtype == TM_FLOAT64) {
        return __double2float_rn(((const double *)x)[i]);
    }
    if (dtype == TM_BFLOAT16) {
        return __bfloat162float(((const __nv_bfloat16 *)x)[i]);
    }
    return dtype == TM_FLOAT16 ? __half2float(((const __half *)x)[i]) : ((const float *)x)[i];
}

/* The clipped gradient as the reference holds it: g * scale rounded to the grad's dtype. */
static __device__ __forceinline__ float
cms_grad(const cms_meta &meta, int32_t s, int64_t i, float scale)
{
    const int dt = meta.dtype[s];
    return cms_round(tm_fmul(cms_load(meta.ptr[CMS_IDX_GRAD][s], i, dt), scale), dt);
}

/* A + g, the accumulator plus the clipped gradient as the reference's add_ rounds it into the
 * float32 buffer (a float64 gradient: clipped and added in double, rounded once). */
static __device__ __forceinline__ float
cms_acc_grad(const cms_meta &meta, int32_t s, int64_t i, float scale, float acc)
{
    if (meta.dtype[s] == TM_FLOAT64) {
        const double g = ((const double *)meta.ptr[CMS_IDX_GRAD][s])[i];
        return tm_cms_acc_add_wide(acc, __dmul_rn(g, (double)scale));
    }
    return tm_fadd(acc, cms_grad(meta, s, i, scale));
}

/* c.div[l] through constant indices only. On an H100 (CUDA 13.0 toolchain, 2026-11-22) this
 * kernel read c.div[l] with a run-time l from its __grid_constant__ parameter as 0.0, in lane 0's
 * branch (the element kernels' same read was right): g^[0] / 0 made the shift kg infinite and
 * every coefficient NaN, and any change of code shape (a printf) could hide it. Every kernel
 * reads the divisor through this, once per level. */
static __device__ __forceinline__ float
cms_level_div(const tm_cms_consts &c, int l)
{
    float d = 1.0f;
#pragma unroll
    for (int k = 0; k < TM_CMS_MAX_LEVELS; k++) {
        d = k == l ? c.div[k] : d;
    }
    return d;
}

/* g^ of element i: (A + g) / div, the accumulate, then the clone's division. */
static __device__ __forceinline__ float
cms_level_grad(const cms_meta &meta, int32_t s, int64_t i, float scale, float acc, float div)
{
    return tm_fdiv(cms_acc_grad(meta, s, i, scale, acc), div);
}

static __device__ __forceinline__ float *
cms_state(const cms_meta &meta, int role, int level, int32_t s)
{
    return (float *)meta.ptr[cms_idx(role, level)][s];
}

struct cms_add {
    __device__ __forceinline__ double
    operator()(double a, double b) const
    {
        return a + b;
    }
};

/* This block's slice of its chunk: tensor slot *s, first element *start, *len elements
 * (0 for the empty slices past a short chunk's end). */
static __device__ __forceinline__ void
cms_locate(const cms_meta &meta, int32_t *s, int64_t *start, int32_t *len)
{
    int64_t chunk_start;
    int32_t chunk_len;
    locate_chunk(meta.t, blockIdx.x, s, &chunk_start, &chunk_len);
    const int32_t slice = TM_CHUNK / TM_CMS_SPLIT;
    const int32_t off = (int32_t)blockIdx.y * slice;
    *start = chunk_start + off;
    *len = chunk_len > off ? min(chunk_len - off, slice) : 0;
}

/* The record of level l written by this block. */
static __device__ __forceinline__ double *
cms_record(const cms_params &p, int l)
{
    const int64_t slice = (p.chunk_base + blockIdx.x) * TM_CMS_SPLIT + blockIdx.y;
    return p.parts + (slice * p.c.levels + l) * p.nparts;
}

/* Deterministic sum of N values over the block (fixed shuffle tree, warps in order); thread 0
 * gets the totals. Every thread must call it. */
template <int N>
static __device__ __forceinline__ void
cms_block_sum(double (&v)[N])
{
    __shared__ double s_part[N][32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const cms_add add;
#pragma unroll
    for (int q = 0; q < N; q++) {
        v[q] = warp_reduce(v[q], add);
        if (lane == 0) {
            s_part[q][warp] = v[q];
        }
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < N; q++) {
        v[q] = (warp == 0 && lane < (int)(blockDim.x >> 5)) ? s_part[q][lane] : 0.0;
        v[q] = warp == 0 ? warp_reduce(v[q], add) : 0.0;
    }
    __syncthreads(); /* s_part is free for the next call */
}

/* cms.cu: the element passes of one batch (grid = its chunks x TM_CMS_SPLIT). */
tm_status cms_launch_stats(const cms_meta &meta, const cms_params &p, cudaStream_t stream);
tm_status cms_launch_update(const cms_meta &meta, const cms_params &p, cudaStream_t stream);
tm_status cms_launch_apply(const cms_meta &meta, const cms_params &p, cudaStream_t stream);

#endif /* TM_CMS_CUH */
