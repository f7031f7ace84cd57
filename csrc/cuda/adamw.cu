/*
 * adamw.cu -- one AdamW step over lists of tensors: torch.optim.AdamW (decoupled weight decay,
 * bias correction, amsgrad, maximize) with the element math of tm_adamw_elem (tm_math.h); shaped
 * after PyTorch's fused_adam_utils.cuh and llm.c's adamw.cuh.
 *
 *   step += 1;  g = grad * grad_scale (negated if maximize);  p *= 1 - lr * wd
 *   with a loss_scale: g = g / loss_scale, stored back into grad (as torch's fused AdamW)
 *   m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g^2;  vmax = max(vmax, v)
 *   p -= lr / (1 - beta1^step) * m / (sqrt(amsgrad ? vmax : v) / sqrt(1 - beta2^step) + eps)
 *
 * Graph-capturable: lr[group], step[i], grad_scale[0], skip[0] and loss_scale[0] are read from
 * device memory (lr, grad_scale: float32 or float64); the host passes pointers and hyperparameters.
 *
 * adamw_kernel<T, DEPTH>: one block per chunk of TM_CHUNK elements (multi_tensor.cuh). Thread 0
 * builds the coefficients from the tensor's step and lr in double (tm_adamw_coeffs_make, _f64 for
 * float64), shared by the block; every thread updates its elements in float32 (tm_adamw_elem), or
 * in double for float64 params (as torch): 16-byte accesses when all the tensor's pointers are
 * 16-byte aligned, element ones for the tail and unaligned views. State has the param's dtype.
 *
 * Step counts, race-free within one launch: a block reads step[i] (thread 0) before it arrives
 * at the completion counter in the caller's scratch (atomicAdd after __threadfence); the block
 * whose arrival makes the count gridDim.x is the last, so every block has read its step: it adds
 * 1 to every step of the launch (numel-0 tensors too) and stores 0 back to the counter for the
 * next launch on the stream (the scratch is zero between calls, as titanmac.h promises; two
 * streams must not share one). The counter is the only atomic; results do not depend on block
 * order. With skip[0] != 0 every block returns before the counter, the steps or any state; with
 * zero_grads_on_skip it first zeroes its chunk of the grad (the DNO's NaN guard).
 * Launches: per dtype present, ceil(its tensors / capacity), capacity 603 (524 with amsgrad) at
 * 32 KB of parameters; more than TM_ADAMW_GROUPS distinct groups also split a launch.
 */
#include "cuda_ops.h"
#include "multi_tensor.cuh"
#include "tm_nvtx.cuh"

/* Distinct param groups per launch (hyperparameters by value, 40 bytes each). */
#define TM_ADAMW_GROUPS (TM_KERNEL_PARAM_BYTES >= 32000 ? 16 : 4)

enum { TM_IDX_PARAM, TM_IDX_GRAD, TM_IDX_EXP_AVG, TM_IDX_EXP_AVG_SQ, TM_IDX_MAX_EXP_AVG_SQ };

struct adamw_group_hp {
    double beta1, beta2, eps, weight_decay;
    int32_t lr_index; /* the group's index in lr (and in args->groups) */
    int32_t maximize;
};

struct adamw_args {
    real_ref lr;             /* [num_groups], float32 or float64 */
    real_ref grad_scale;     /* [1], float32 or float64; ptr NULL = 1 */
    const float *skip;       /* [1], NULL = never */
    unsigned int *counter;   /* scratch: finished blocks of the running launch */
    int32_t zero_grads;      /* zero_grads_on_skip */
    const float *loss_scale; /* [1], NULL = none: no division, no store */
};

/* DEPTH 4: p, g, m, v; DEPTH 5: + vmax (amsgrad). Indexed by TM_IDX_*. */
template <int DEPTH> struct adamw_meta {
    static constexpr int depth = DEPTH;
    static constexpr int capacity =
        cuda_meta_capacity(DEPTH * sizeof(void *) + sizeof(float *) + 1,
                           sizeof(adamw_args) + TM_ADAMW_GROUPS * sizeof(adamw_group_hp) + 8);
    adamw_group_hp groups[TM_ADAMW_GROUPS];
    void *ptr[DEPTH][capacity];
    float *step[capacity];
    tensor_table<capacity> t;
    uint8_t slot[capacity]; /* index into groups */
    int32_t num_groups;
};
static_assert(sizeof(adamw_meta<4>) + sizeof(adamw_args) <= TM_KERNEL_PARAM_BYTES, "params");
static_assert(sizeof(adamw_meta<5>) + sizeof(adamw_args) <= TM_KERNEL_PARAM_BYTES, "params");
static_assert(TM_ADAMW_GROUPS <= 256, "slot is a uint8_t");

/* The coefficients of T's compute type: double ones (tm_math.h's _f64 math) for float64. */
template <typename T>
using adamw_coeffs_t =
    std::conditional_t<std::is_same_v<T, double>, tm_adamw_coeffs_f64, tm_adamw_coeffs>;

/* Coefficients of tensor i. torch increments the float32 step tensor, then takes its value as a
 * Python float for the bias corrections: step + 1 in float32, the rest in double. Float ones take
 * grad_scale rounded to float, as the CPU's (a float32 grad_scale passes unchanged). */
template <typename T, int DEPTH>
static __device__ __forceinline__ adamw_coeffs_t<T>
adamw_coeffs_of(const adamw_meta<DEPTH> &meta, const adamw_args &args, int32_t i)
{
    const adamw_group_hp &g = meta.groups[meta.slot[i]];
    const double step = (double)(meta.step[i][0] + 1.0f);
    const double lr = load_real(args.lr, g.lr_index);
    const double scale = args.grad_scale.ptr != NULL ? load_real(args.grad_scale, 0) : 1.0;
    adamw_coeffs_t<T> c;
    if constexpr (std::is_same_v<T, double>) {
        c = tm_adamw_coeffs_f64_make(lr, g.beta1, g.beta2, g.eps, g.weight_decay, step, scale,
                                     g.maximize, DEPTH == 5);
    } else {
        c = tm_adamw_coeffs_make(lr, g.beta1, g.beta2, g.eps, g.weight_decay, step, (float)scale,
                                 g.maximize, DEPTH == 5);
    }
    if (args.loss_scale != NULL) {
        c.loss_scale = args.loss_scale[0]; /* float32; widened exactly for float64 params */
    }
    return c;
}

/* One element of any dtype: widen to its compute type, the element math, round once. x is touched
 * only with AMS, g is written only with UNSCALE (the gradient divided by the loss scale). */
template <typename T, bool AMS, bool UNSCALE>
static __device__ __forceinline__ void
adamw_apply(T &p, T &g, T &m, T &v, T *x, const adamw_coeffs_t<T> &c)
{
    real_t<T> pf = to_real(p);
    real_t<T> mf = to_real(m);
    real_t<T> vf = to_real(v);
    real_t<T> xf = AMS ? to_real(*x) : (real_t<T>)0;
    real_t<T> gf;
    if constexpr (std::is_same_v<T, double>) {
        gf = tm_adamw_scaled_grad_f64(g, &c, UNSCALE);
        tm_adamw_elem_f64(&pf, &mf, &vf, &xf, gf, &c);
    } else {
        gf = tm_adamw_scaled_grad(to_float(g), &c, UNSCALE);
        tm_adamw_elem(&pf, &mf, &vf, &xf, gf, &c);
    }
    p = from_real<T>(pf);
    m = from_real<T>(mf);
    v = from_real<T>(vf);
    if constexpr (AMS) {
        *x = from_real<T>(xf);
    }
    if constexpr (UNSCALE) {
        g = from_real<T>(gf);
    }
}

/* Vector k (16 bytes of each tensor) of a chunk whose pointers are all 16-byte aligned. */
template <typename T, bool AMS, bool UNSCALE>
static __device__ __forceinline__ void
adamw_vec(T *p, T *g, T *m, T *v, T *x, int32_t k, const adamw_coeffs_t<T> &c)
{
    vec16<T> rp = reinterpret_cast<const vec16<T> *>(p)[k];
    vec16<T> rg = reinterpret_cast<const vec16<T> *>(g)[k];
    vec16<T> rm = reinterpret_cast<const vec16<T> *>(m)[k];
    vec16<T> rv = reinterpret_cast<const vec16<T> *>(v)[k];
    vec16<T> rx = rv; /* placeholder without amsgrad; never read then */
    if constexpr (AMS) {
        rx = reinterpret_cast<const vec16<T> *>(x)[k];
    }
#pragma unroll
    for (int e = 0; e < (int)(TM_VEC_BYTES / sizeof(T)); e++) {
        adamw_apply<T, AMS, UNSCALE>(rp.v[e], rg.v[e], rm.v[e], rv.v[e], &rx.v[e], c);
    }
    reinterpret_cast<vec16<T> *>(p)[k] = rp;
    reinterpret_cast<vec16<T> *>(m)[k] = rm;
    reinterpret_cast<vec16<T> *>(v)[k] = rv;
    if constexpr (AMS) {
        reinterpret_cast<vec16<T> *>(x)[k] = rx;
    }
    if constexpr (UNSCALE) {
        reinterpret_cast<vec16<T> *>(g)[k] = rg;
    }
}

/* This thread's elements of chunk [start, start + len) of tensor i; with UNSCALE the gradients
 * are divided by the loss scale and stored back. */
template <typename T, int DEPTH, bool UNSCALE>
static __device__ __forceinline__ void
adamw_chunk(const adamw_meta<DEPTH> &meta, int32_t i, int64_t start, int32_t len,
            const adamw_coeffs_t<T> &c)
{
    constexpr bool AMS = DEPTH == 5;
    constexpr int32_t VEC = TM_VEC_BYTES / sizeof(T);
    T *p = (T *)meta.ptr[TM_IDX_PARAM][i] + start;
    T *g = (T *)meta.ptr[TM_IDX_GRAD][i] + start; /* written only with UNSCALE */
    T *m = (T *)meta.ptr[TM_IDX_EXP_AVG][i] + start;
    T *v = (T *)meta.ptr[TM_IDX_EXP_AVG_SQ][i] + start;
    T *x = p; /* aligned whenever p is; never accessed without amsgrad */
    if constexpr (AMS) {
        x = (T *)meta.ptr[TM_IDX_MAX_EXP_AVG_SQ][i] + start;
    }
    const bool aligned = is_aligned16(p) && is_aligned16(g) && is_aligned16(m) &&
                         is_aligned16(v) && is_aligned16(x);
    const int32_t nvec = aligned ? len / VEC : 0;
    for (int32_t k = threadIdx.x; k < nvec; k += TM_BLOCK) {
        adamw_vec<T, AMS, UNSCALE>(p, g, m, v, x, k, c);
    }
    for (int32_t k = nvec * VEC + threadIdx.x; k < len; k += TM_BLOCK) {
        adamw_apply<T, AMS, UNSCALE>(p[k], g[k], m[k], v[k], x + k, c);
    }
}

/* The completion-counter protocol of the file comment. Every thread of every block calls it. */
template <int DEPTH>
static __device__ __forceinline__ void
adamw_count_steps(const adamw_meta<DEPTH> &meta, unsigned int *counter)
{
    __shared__ bool s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence(); /* release: this block's read of step[i] comes before its arrival */
        const unsigned int arrived = atomicAdd(counter, 1u);
        __threadfence(); /* acquire: every other block's read comes before our writes below */
        s_last = arrived == gridDim.x - 1;
    }
    __syncthreads();
    if (s_last) {
        for (int32_t j = threadIdx.x; j < meta.t.count; j += TM_BLOCK) {
            meta.step[j][0] += 1.0f;
        }
        if (threadIdx.x == 0) {
            *counter = 0u;
        }
    }
}

/* Skipped step with zero_grads_on_skip: this block's chunk of the grad becomes +0.0. */
template <typename T, int DEPTH>
static __device__ __forceinline__ void
adamw_zero_grad_chunk(const adamw_meta<DEPTH> &meta)
{
    int32_t i;
    int32_t len;
    int64_t start;
    locate_chunk(meta.t, blockIdx.x, &i, &start, &len);
    T *g = (T *)meta.ptr[TM_IDX_GRAD][i] + start;
    const T zero = from_real<T>(0);
    for (int32_t k = threadIdx.x; k < len; k += TM_BLOCK) {
        g[k] = zero;
    }
}

/* Block b -> chunk b of the launch. A launch holding only numel-0 tensors has one block with no
 * chunk, which still counts their steps. */
template <typename T, int DEPTH>
__global__ void __launch_bounds__(TM_BLOCK, TM_MIN_BLOCKS)
adamw_kernel(const __grid_constant__ adamw_meta<DEPTH> meta, const adamw_args args)
{
    __shared__ adamw_coeffs_t<T> s_coeffs;
    const bool has_chunk = blockIdx.x < meta.t.num_chunks;
    if (args.skip != NULL && args.skip[0] != 0.0f) {
        if (args.zero_grads && has_chunk) {
            adamw_zero_grad_chunk<T>(meta);
        }
        return; /* the same answer in every block: no step, no state, counter untouched */
    }
    int32_t i = 0;
    int32_t len = 0;
    int64_t start = 0;
    if (has_chunk) {
        locate_chunk(meta.t, blockIdx.x, &i, &start, &len);
        if (threadIdx.x == 0) {
            s_coeffs = adamw_coeffs_of<T>(meta, args, i);
        }
    }
    __syncthreads();
    if (has_chunk) {
        adamw_coeffs_t<T> c = s_coeffs;
        c.amsgrad = DEPTH == 5; /* a constant, so the element function's branch folds */
        if (args.loss_scale != NULL) { /* the same in every thread: no divergence */
            adamw_chunk<T, DEPTH, true>(meta, i, start, len, c);
        } else {
            adamw_chunk<T, DEPTH, false>(meta, i, start, len, c);
        }
    }
    adamw_count_steps(meta, args.counter);
}

template <typename T, int DEPTH>
static tm_status
adamw_launch(const adamw_meta<DEPTH> &meta, const adamw_args &args, cudaStream_t stream)
{
    const unsigned int blocks = meta.t.num_chunks > 0 ? meta.t.num_chunks : 1u;
    adamw_kernel<T, DEPTH><<<blocks, TM_BLOCK, 0, stream>>>(meta, args);
    TM_CUDA_CHECK(cudaGetLastError());
    return TM_OK;
}

/* The op as multi_tensor_apply walks it: the params of one dtype, numel-0 ones included. */
struct adamw_walk {
    static constexpr bool keep_empty = true;
    const tm_adamw_tensors *t;
    const tm_adamw_args *hp;
    adamw_args args;
    tm_dtype dtype;
    cudaStream_t stream;

    int32_t
    group_of(int32_t i) const
    {
        return hp->group_of != NULL ? hp->group_of[i] : 0;
    }

    bool
    include(int32_t i) const
    {
        return t->params.tensors[i].dtype == dtype;
    }

    int64_t
    numel(int32_t i) const
    {
        return t->params.tensors[i].numel;
    }

    template <typename Meta>
    int
    find_group(const Meta &m, int32_t g) const
    {
        for (int k = 0; k < m.num_groups; k++) {
            if (m.groups[k].lr_index == g) {
                return k;
            }
        }
        return -1;
    }

    template <typename Meta>
    bool
    fits(const Meta &m, int32_t i) const
    {
        return m.num_groups < TM_ADAMW_GROUPS || find_group(m, group_of(i)) >= 0;
    }

    template <typename Meta>
    void
    clear(Meta &m) const
    {
        m.num_groups = 0;
    }

    template <typename Meta>
    void
    fill(Meta &m, int32_t slot, int32_t i) const
    {
        const int32_t g = group_of(i);
        int k = find_group(m, g);
        if (k < 0) {
            const tm_adamw_group *src = &hp->groups[g];
            k = m.num_groups++;
            m.groups[k] = adamw_group_hp{src->beta1, src->beta2, src->eps, src->weight_decay,
                                         g,           src->maximize};
        }
        m.slot[slot] = (uint8_t)k;
        m.ptr[TM_IDX_PARAM][slot] = t->params.tensors[i].data;
        m.ptr[TM_IDX_GRAD][slot] = t->grads.tensors[i].data;
        m.ptr[TM_IDX_EXP_AVG][slot] = t->exp_avg.tensors[i].data;
        m.ptr[TM_IDX_EXP_AVG_SQ][slot] = t->exp_avg_sq.tensors[i].data;
        if constexpr (Meta::depth == 5) {
            m.ptr[TM_IDX_MAX_EXP_AVG_SQ][slot] = t->max_exp_avg_sq.tensors[i].data;
        }
        m.step[slot] = (float *)t->step.tensors[i].data;
    }

    template <typename Meta>
    tm_status
    launch(const Meta &m, int64_t) const
    {
        switch (dtype) {
        case TM_FLOAT16:
            return adamw_launch<__half>(m, args, stream);
        case TM_BFLOAT16:
            return adamw_launch<__nv_bfloat16>(m, args, stream);
        case TM_FLOAT64:
            return adamw_launch<double>(m, args, stream);
        default: /* TM_FLOAT32 */
            return adamw_launch<float>(m, args, stream);
        }
    }
};

size_t
cuda_adamw_scratch_bytes(const tm_adamw_tensors *t)
{
    return t->params.count > 0 ? sizeof(unsigned int) : 0;
}

tm_status
cuda_adamw_step(const tm_adamw_tensors *t, const tm_adamw_args *args, const tm_adamw_inputs *in,
                const tm_exec *exec)
{
    TM_NVTX_RANGE("cuda_adamw_step");
    static const tm_dtype dtypes[] = {TM_FLOAT32, TM_FLOAT16, TM_BFLOAT16, TM_FLOAT64};
    static_assert(sizeof(dtypes) / sizeof(dtypes[0]) == TM_DTYPE_COUNT, "a launch series each");
    cuda_device_guard guard;
    TM_TRY(guard.enter(in->lr.device_id));
    adamw_walk walk;
    walk.t = t;
    walk.hp = args;
    walk.args.lr = real_ref_of(in->lr);
    walk.args.grad_scale = real_ref_of(in->grad_scale); /* ptr NULL when not given */
    walk.args.skip = (const float *)in->skip.data;
    walk.args.counter = (unsigned int *)exec->scratch;
    walk.args.zero_grads = args->zero_grads_on_skip != 0;
    walk.args.loss_scale = (const float *)in->loss_scale.data; /* NULL when not given */
    walk.stream = cuda_stream_of(exec);
    for (tm_dtype dtype : dtypes) { /* one launch series per dtype: T is a template parameter */
        walk.dtype = dtype;
        if (args->amsgrad) {
            TM_TRY(multi_tensor_apply<adamw_meta<5>>(walk, t->params.count));
        } else {
            TM_TRY(multi_tensor_apply<adamw_meta<4>>(walk, t->params.count));
        }
    }
    return TM_OK;
}
