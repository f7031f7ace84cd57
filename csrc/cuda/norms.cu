/*
 * norms.cu -- per-group and total p-norms of gradients (and of parameters) plus the non-finite
 * flag, as a deterministic two-pass reduction (llm.c global_norm.cuh with
 * global_sum_deterministic; apex multi_tensor_l2norm_kernel.cu with its cleanup kernel).
 *
 *   ||x||_p = (sum_i |x_i|^p)^(1/p)     ||x||_inf = max_i |x_i|     (NaN in, NaN out, as torch)
 *   group g: every element of every tensor i with group_of[i] == g; total: every element.
 *
 * Pass 1, norms_kernel, grid (chunks, kinds): block (j, k) reduces chunk j of list k (0 grads,
 * 1 params) to one record. Each thread accumulates |x|^p in double (tm_pow_abs returns double:
 * a float accumulator would cost one more conversion per element and lose bits), then the block
 * combines its threads with a fixed shuffle tree. The record also carries the tensor's group and
 * (p not 1, 2 or inf) whether an element was NaN or Inf. float64 elements are read as doubles
 * (vec16<double>, to_wide) and never pass through float; the others widen exactly.
 * Pass 2, norms_finish_kernel, one block: thread t combines records t, t + 256, ... in order into
 * its own column per group (shared memory, 8 groups per walk over the records) and into its
 * total; then one warp per (kind, group) column combines the 256 columns in a fixed tree, and the
 * block does the same for the totals. tm_norm_finish turns sums into norms (in double), and each
 * output is stored in its own dtype, float32 or float64, rounded once.
 * Every record is written by exactly one block and read in a fixed order: no atomics, and the
 * same bits on every run whatever the launch split.
 *
 * Non-finite flag, as cpu_norms.c sets it: for p = 1, 2, inf pass 2 tests the reduced grad total
 * (for float data exactly "an element is NaN or Inf": a float squared cannot overflow a double,
 * nor can 2^40 of them summed; a float64 sum may also overflow, as torch's total_norm would); for
 * other p, |x|^p may overflow, so pass 1 tests each element (isfinite of the double).
 *
 * Scratch (cuda_norms_scratch_bytes): norm_partial[kinds][num_chunks], kinds = 2 when params are
 * given; record c + sum over t < i of ceil(numel_t / TM_CHUNK) is chunk c of tensor i, written
 * by pass 1 in every call (no zeroing). Launches: ceil(non-empty tensors / capacity) of pass 1
 * (capacity 989 with params, 1,306 without, at 32 KB of parameters), then one of pass 2.
 */
#include "cuda_ops.h"
#include "multi_tensor.cuh"
#include "tm_nvtx.cuh"

#define TM_FINISH_BLOCK 256 /* threads of the one pass-2 block */
#define TM_FINISH_GROUPS 8  /* groups per walk over the records: 2 x 8 x 256 doubles = 32 KB */

enum norm_mode { NORM_L1, NORM_L2, NORM_LP, NORM_LINF };

struct norm_partial {
    double value;       /* sum |x|^p, or max |x|, over the chunk */
    uint32_t group;     /* group_of[tensor] */
    uint32_t nonfinite; /* NORM_LP only: 1 when an element of the chunk is NaN or Inf */
};
static_assert(sizeof(norm_partial) == 16 && alignof(norm_partial) == 8, "the scratch is 8-aligned");

/* a + b, or max that propagates NaN; a float64 maximum stays a double (never rounded to float). */
struct norm_combine {
    bool is_max;

    __device__ __forceinline__ double
    operator()(double a, double b) const
    {
        return is_max ? tm_max_abs_nan(a, b) : a + b;
    }
};

/* ---------------------------------------------------------------- pass 1 ---- */

struct norms_args {
    norm_partial *partials; /* scratch */
    int64_t num_chunks;     /* records per kind, whole call */
    int64_t chunk_base;     /* chunks of the earlier launches of this call */
    double p;
};

template <int KINDS> struct norms_meta {
    static constexpr int kinds = KINDS;
    static constexpr int capacity =
        cuda_meta_capacity(KINDS * sizeof(void *) + sizeof(uint32_t) + 1, sizeof(norms_args));
    const void *ptr[KINDS][capacity]; /* [0] grads[i].data, [1] params[i].data */
    tensor_table<capacity> t;
    uint32_t group[capacity];
    uint8_t dtypes[capacity]; /* grads[i].dtype | params[i].dtype << 4 */
};
static_assert(TM_DTYPE_COUNT <= 16, "a dtype fits in 4 bits of norms_meta::dtypes");
static_assert(sizeof(norms_meta<1>) + sizeof(norms_args) <= TM_KERNEL_PARAM_BYTES, "params");
static_assert(sizeof(norms_meta<2>) + sizeof(norms_args) <= TM_KERNEL_PARAM_BYTES, "params");

template <int MODE>
static __device__ __forceinline__ void
norm_add(double &acc, int &bad, double x, double p)
{
    if constexpr (MODE == NORM_LINF) {
        acc = tm_max_abs_nan(acc, x);
    } else if constexpr (MODE == NORM_L2) {
        acc += tm_pow_abs(x, 2.0); /* constant p: tm_pow_abs folds to one multiply */
    } else if constexpr (MODE == NORM_L1) {
        acc += tm_pow_abs(x, 1.0);
    } else {
        acc += tm_pow_abs(x, p);
        bad |= !isfinite(x);
    }
}

/* This thread's share of one chunk: 16-byte loads (2 to 8 elements), TM_ILP in flight, when the
 * chunk is 16-byte aligned; element loads for the tail and for unaligned views. */
template <int MODE, typename T>
static __device__ __forceinline__ void
norm_chunk(const T *x, int32_t len, double p, double &acc, int &bad)
{
    constexpr int32_t VEC = TM_VEC_BYTES / sizeof(T);
    const int32_t nvec = is_aligned16(x) ? len / VEC : 0;
    const vec16<T> *xv = reinterpret_cast<const vec16<T> *>(x);
    for (int32_t k0 = threadIdx.x; k0 < nvec; k0 += TM_BLOCK * TM_ILP) {
        vec16<T> r[TM_ILP];
#pragma unroll
        for (int u = 0; u < TM_ILP; u++) {
            if (k0 + u * TM_BLOCK < nvec) {
                r[u] = xv[k0 + u * TM_BLOCK];
            }
        }
#pragma unroll
        for (int u = 0; u < TM_ILP; u++) {
#pragma unroll
            for (int e = 0; e < VEC; e++) {
                if (k0 + u * TM_BLOCK < nvec) {
                    norm_add<MODE>(acc, bad, to_wide(r[u].v[e]), p);
                }
            }
        }
    }
    for (int32_t k = nvec * VEC + threadIdx.x; k < len; k += TM_BLOCK) {
        norm_add<MODE>(acc, bad, to_wide(x[k]), p);
    }
}

/* Block (j, kind) -> record kind * num_chunks + chunk_base + j. Precision: double from the first
 * element on; the tree order is fixed. */
template <int MODE, int KINDS>
__global__ void __launch_bounds__(TM_BLOCK)
norms_kernel(const __grid_constant__ norms_meta<KINDS> meta, const norms_args args)
{
    const int kind = (int)blockIdx.y;
    int32_t i;
    int32_t len;
    int64_t start;
    locate_chunk(meta.t, blockIdx.x, &i, &start, &len);
    const void *x = meta.ptr[kind][i];
    double acc = 0.0;
    int bad = 0;
    switch ((meta.dtypes[i] >> (4 * kind)) & 0xF) {
    case TM_FLOAT16:
        norm_chunk<MODE>((const __half *)x + start, len, args.p, acc, bad);
        break;
    case TM_BFLOAT16:
        norm_chunk<MODE>((const __nv_bfloat16 *)x + start, len, args.p, acc, bad);
        break;
    case TM_FLOAT64:
        norm_chunk<MODE>((const double *)x + start, len, args.p, acc, bad);
        break;
    default: /* TM_FLOAT32 */
        norm_chunk<MODE>((const float *)x + start, len, args.p, acc, bad);
        break;
    }
    if constexpr (MODE == NORM_LP) { /* else the flag comes from the total (pass 2) */
        bad = __syncthreads_or(bad);
    }
    acc = block_reduce(acc, norm_combine{MODE == NORM_LINF});
    if (threadIdx.x == 0) {
        const int64_t j = kind * args.num_chunks + args.chunk_base + blockIdx.x;
        args.partials[j] = norm_partial{acc, meta.group[i], bad != 0 ? 1u : 0u};
    }
}

template <int KINDS>
static tm_status
norms_launch(const norms_meta<KINDS> &meta, const norms_args &args, int mode,
             cudaStream_t stream)
{
    const dim3 grid(meta.t.num_chunks, KINDS);
    switch (mode) {
    case NORM_L1:
        norms_kernel<NORM_L1, KINDS><<<grid, TM_BLOCK, 0, stream>>>(meta, args);
        break;
    case NORM_L2:
        norms_kernel<NORM_L2, KINDS><<<grid, TM_BLOCK, 0, stream>>>(meta, args);
        break;
    case NORM_LINF:
        norms_kernel<NORM_LINF, KINDS><<<grid, TM_BLOCK, 0, stream>>>(meta, args);
        break;
    default:
        norms_kernel<NORM_LP, KINDS><<<grid, TM_BLOCK, 0, stream>>>(meta, args);
        break;
    }
    TM_CUDA_CHECK(cudaGetLastError());
    return TM_OK;
}

/* The op as multi_tensor_apply walks it: one table entry per non-empty grad (and its param). */
struct norms_walk {
    static constexpr bool keep_empty = false;
    const tm_tensor_list *grads;
    const tm_tensor_list *params; /* NULL when no params are given */
    const int32_t *group_of;      /* NULL: all in group 0 */
    norms_args args;
    int mode;
    cudaStream_t stream;

    bool include(int32_t) const { return true; }
    int64_t numel(int32_t i) const { return grads->tensors[i].numel; }
    template <typename Meta> bool fits(const Meta &, int32_t) const { return true; }
    template <typename Meta> void clear(Meta &) const {}

    template <typename Meta>
    void
    fill(Meta &m, int32_t slot, int32_t i) const
    {
        unsigned dtypes = (unsigned)grads->tensors[i].dtype;
        m.ptr[0][slot] = grads->tensors[i].data;
        if constexpr (Meta::kinds == 2) {
            m.ptr[1][slot] = params->tensors[i].data;
            dtypes |= (unsigned)params->tensors[i].dtype << 4;
        }
        m.group[slot] = group_of != NULL ? (uint32_t)group_of[i] : 0u;
        m.dtypes[slot] = (uint8_t)dtypes;
    }

    template <typename Meta>
    tm_status
    launch(const Meta &m, int64_t chunk_base) const
    {
        norms_args a = args;
        a.chunk_base = chunk_base;
        return norms_launch<Meta::kinds>(m, a, mode, stream);
    }
};

/* ---------------------------------------------------------------- pass 2 ---- */

struct norms_finish_args {
    const norm_partial *partials;
    int64_t num_chunks;
    double p;
    double max_norm;
    int32_t num_groups;
    int32_t kinds;
    int32_t mode;          /* norm_mode */
    real_ref group_out[2]; /* group_grad, group_param (ptr NULL: not wanted, as below) */
    real_ref total_out[2]; /* total_grad, total_param */
    real_ref nonfinite;
    real_ref coef; /* clip coefficient of total_grad */
    tm_dtype result_dtype; /* the coefficient's norm: total_grad rounded to it */
};

typedef double finish_cols[TM_FINISH_GROUPS][TM_FINISH_BLOCK];

/* Thread t folds records t, t + 256, ... in order into its column of groups g0..g0+7, and on the
 * first walk into its totals and its non-finite flag (grads only; 0 unless NORM_LP). */
static __device__ __forceinline__ void
finish_sweep(const norms_finish_args &a, norm_combine op, int64_t g0, finish_cols *col,
             double *total, int *bad)
{
    const int tid = threadIdx.x;
    for (int k = 0; k < 2; k++) {
        for (int w = 0; w < TM_FINISH_GROUPS; w++) {
            col[k][w][tid] = 0.0;
        }
    }
#pragma unroll 4 /* lets the loads of four records be in flight at once */
    for (int64_t j = tid; j < a.num_chunks; j += TM_FINISH_BLOCK) {
#pragma unroll
        for (int k = 0; k < 2; k++) {
            if (k < a.kinds) {
                const norm_partial r = a.partials[k * a.num_chunks + j];
                const int64_t w = (int64_t)r.group - g0;
                if (w >= 0 && w < TM_FINISH_GROUPS) {
                    col[k][w][tid] = op(col[k][w][tid], r.value);
                }
                if (g0 == 0) {
                    total[k] = op(total[k], r.value);
                    *bad |= k == 0 ? (int)r.nonfinite : 0;
                }
            }
        }
    }
}

/* One warp per (kind, group) column: lanes fold the 256 thread columns in a fixed order. */
static __device__ __forceinline__ void
finish_columns(const norms_finish_args &a, norm_combine op, int64_t g0, finish_cols *col)
{
    const int lane = threadIdx.x & 31;
    for (int c = threadIdx.x >> 5; c < 2 * TM_FINISH_GROUPS; c += TM_FINISH_BLOCK / 32) {
        const int k = c / TM_FINISH_GROUPS;
        const int w = c % TM_FINISH_GROUPS;
        if (g0 + w >= a.num_groups || a.group_out[k].ptr == NULL) {
            continue; /* uniform across the warp */
        }
        double v = 0.0;
        for (int t = lane; t < TM_FINISH_BLOCK; t += 32) {
            v = op(v, col[k][w][t]);
        }
        v = warp_reduce(v, op);
        if (lane == 0) {
            store_real(a.group_out[k], g0 + w, tm_norm_finish(v, a.p));
        }
    }
}

/* One block. A group without elements gets 0, as does a param output when no params exist. */
__global__ void __launch_bounds__(TM_FINISH_BLOCK)
norms_finish_kernel(const __grid_constant__ norms_finish_args a)
{
    __shared__ finish_cols s_col[2];
    const norm_combine op{a.mode == NORM_LINF};
    double total[2] = {0.0, 0.0};
    int bad = 0;
    for (int64_t g0 = 0; g0 < a.num_groups; g0 += TM_FINISH_GROUPS) {
        finish_sweep(a, op, g0, s_col, total, &bad);
        __syncthreads();
        finish_columns(a, op, g0, s_col);
        __syncthreads(); /* the columns are rewritten by the next walk */
    }
    bad = __syncthreads_or(bad);
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const double v = block_reduce(total[k], op);
        if (threadIdx.x == 0 && k == 0 && a.mode != NORM_LP) { /* else: from the records */
            bad = !isfinite(v);
        }
        if (threadIdx.x == 0 && a.total_out[k].ptr != NULL) {
            store_real(a.total_out[k], 0, tm_norm_finish(v, a.p));
            if (k == 0 && a.coef.ptr != NULL) {
                /* from the norm as stored and rounded to the dtype the caller returns it in, as
                 * cuda_clip_coef computes it from that returned norm */
                store_clip_coef(a.coef, round_to_dtype(load_real(a.total_out[0], 0),
                                                       a.result_dtype), a.max_norm);
            }
        }
    }
    if (threadIdx.x == 0 && a.nonfinite.ptr != NULL) {
        store_real(a.nonfinite, 0, bad ? 1.0 : 0.0);
    }
}

/* ---------------------------------------------------------------- entry points ---- */

static bool
params_given(const tm_tensor_list *params)
{
    return params != NULL && params->count > 0;
}

static int
norm_mode_of(double p)
{
    if (isinf(p)) {
        return NORM_LINF;
    }
    return p == 2.0 ? NORM_L2 : (p == 1.0 ? NORM_L1 : NORM_LP);
}

size_t
cuda_norms_scratch_bytes(const tm_tensor_list *grads, const tm_tensor_list *params)
{
    const size_t kinds = params_given(params) ? 2 : 1;
    return kinds * (size_t)cuda_list_chunks(grads) * sizeof(norm_partial);
}

tm_status
cuda_norms(const tm_tensor_list *grads, const tm_tensor_list *params, const tm_norms_args *args,
           const tm_norms_out *out, const tm_exec *exec)
{
    TM_NVTX_RANGE("cuda_norms");
    cuda_device_guard guard;
    TM_TRY(guard.enter(out->total_grad.device_id));
    const bool with_params = params_given(params);
    norms_walk walk;
    walk.grads = grads;
    walk.params = with_params ? params : NULL;
    walk.group_of = args->group_of;
    walk.args.partials = (norm_partial *)exec->scratch;
    walk.args.num_chunks = cuda_list_chunks(grads);
    walk.args.chunk_base = 0;
    walk.args.p = args->norm_type;
    walk.mode = norm_mode_of(args->norm_type);
    walk.stream = cuda_stream_of(exec);
    if (with_params) {
        TM_TRY(multi_tensor_apply<norms_meta<2>>(walk, grads->count));
    } else {
        TM_TRY(multi_tensor_apply<norms_meta<1>>(walk, grads->count));
    }
    norms_finish_args fin;
    fin.partials = walk.args.partials;
    fin.num_chunks = walk.args.num_chunks;
    fin.p = args->norm_type;
    fin.num_groups = args->num_groups;
    fin.kinds = with_params ? 2 : 1;
    fin.mode = walk.mode;
    fin.group_out[0] = real_ref_of(out->group_grad);
    fin.group_out[1] = real_ref_of(out->group_param);
    fin.total_out[0] = real_ref_of(out->total_grad);
    fin.total_out[1] = real_ref_of(out->total_param);
    fin.nonfinite = real_ref_of(out->nonfinite);
    fin.coef = real_ref_of(out->coef);
    fin.max_norm = args->max_norm;
    fin.result_dtype = args->result_dtype;
    norms_finish_kernel<<<1, TM_FINISH_BLOCK, 0, walk.stream>>>(fin);
    TM_CUDA_CHECK(cudaGetLastError());
    return TM_OK;
}
