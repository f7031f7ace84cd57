/*
 * clip.cu -- the two device halves of torch.nn.utils.clip_grad_norm_:
 *   coef[0] = min(1, max_norm / (total_norm[0] + 1e-6))   tm_clip_coef_elem, torch's order
 *   x *= scale[0] for every tensor x of a list             clip_grads_with_norm_'s foreach mul
 * Both read their scalar from device memory, so the host never waits and both can be captured in
 * a CUDA graph (llm.c computes its clip factor on the device the same way; torch itself offers
 * get_total_norm and clip_grads_with_norm_ as separate calls for the same reason).
 *
 * coef and scale may each be float32 or float64 (real_ref carries which); total_norm may also be
 * float16 or bfloat16 (the norm as returned for such gradients, whose value the coefficient is of).
 *
 * clip_coef_kernel: one thread, one element, in coef's arithmetic (tm_real_store_clip_coef, as the
 * CPU): float32 from the norm rounded to float, double from the norm as a double.
 * scale_kernel: one block per chunk of TM_CHUNK elements (multi_tensor.cuh); 16-byte loads and
 * stores, TM_ILP in flight, when the tensor is 16-byte aligned, element accesses for the tail and
 * for unaligned views. A float64 tensor is multiplied by the factor as a double; the others by
 * the factor rounded to float, in float32, rounded once to the tensor's dtype (torch multiplies
 * each gradient by the coefficient cast to its dtype). A block switches on its tensor's dtype, so
 * a list mixing dtypes still takes ceil(non-empty tensors / 1,500) launches at 32 KB of
 * parameters.
 */
#include "cuda_ops.h"
#include "multi_tensor.cuh"
#include "tm_nvtx.cuh"

/* ---------------------------------------------------------------- clip coefficient ---- */

__global__ void
clip_coef_kernel(const void *total_norm, tm_dtype norm_dtype, double max_norm,
                 const real_ref coef)
{
    store_clip_coef(coef, load_scalar(total_norm, norm_dtype), max_norm);
}

tm_status
cuda_clip_coef(const tm_tensor *total_norm, double max_norm, const tm_tensor *coef,
               const tm_exec *exec)
{
    TM_NVTX_RANGE("cuda_clip_coef");
    cuda_device_guard guard;
    TM_TRY(guard.enter(total_norm->device_id));
    /* torch multiplies a float32 tensor by the Python float max_norm in float32, a float64 one
     * in double: store_clip_coef rounds max_norm for a float32 coef */
    clip_coef_kernel<<<1, 1, 0, cuda_stream_of(exec)>>>(total_norm->data, total_norm->dtype,
                                                        max_norm, real_ref_of(*coef));
    TM_CUDA_CHECK(cudaGetLastError());
    return TM_OK;
}

/* ---------------------------------------------------------------- scale ---- */

struct scale_meta {
    static constexpr int capacity = cuda_meta_capacity(sizeof(void *) + 1, sizeof(real_ref));
    void *ptr[capacity];
    tensor_table<capacity> t;
    uint8_t dtype[capacity];
};
static_assert(sizeof(scale_meta) + sizeof(real_ref) <= TM_KERNEL_PARAM_BYTES, "params");

/* This thread's share of one chunk, in place, in T's compute type (s already rounded to it). */
template <typename T>
static __device__ __forceinline__ void
scale_chunk(T *x, int32_t len, real_t<T> s)
{
    constexpr int32_t VEC = TM_VEC_BYTES / sizeof(T);
    const int32_t nvec = is_aligned16(x) ? len / VEC : 0;
    vec16<T> *xv = reinterpret_cast<vec16<T> *>(x);
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
            if (k0 + u * TM_BLOCK < nvec) {
#pragma unroll
                for (int e = 0; e < VEC; e++) {
                    r[u].v[e] = from_real<T>(to_real(r[u].v[e]) * s);
                }
                xv[k0 + u * TM_BLOCK] = r[u];
            }
        }
    }
    for (int32_t k = nvec * VEC + threadIdx.x; k < len; k += TM_BLOCK) {
        x[k] = from_real<T>(to_real(x[k]) * s);
    }
}

/* Block b -> chunk b of the launch; every thread reads the scale (one broadcast load). */
__global__ void __launch_bounds__(TM_BLOCK)
scale_kernel(const __grid_constant__ scale_meta meta, const real_ref scale)
{
    int32_t i;
    int32_t len;
    int64_t start;
    locate_chunk(meta.t, blockIdx.x, &i, &start, &len);
    const double s = load_real(scale, 0);
    void *x = meta.ptr[i];
    switch (meta.dtype[i]) {
    case TM_FLOAT16:
        scale_chunk((__half *)x + start, len, (float)s);
        break;
    case TM_BFLOAT16:
        scale_chunk((__nv_bfloat16 *)x + start, len, (float)s);
        break;
    case TM_FLOAT64:
        scale_chunk((double *)x + start, len, s);
        break;
    default: /* TM_FLOAT32 */
        scale_chunk((float *)x + start, len, (float)s);
        break;
    }
}

/* The op as multi_tensor_apply walks it: one table entry per non-empty tensor. */
struct scale_walk {
    static constexpr bool keep_empty = false;
    const tm_tensor_list *tensors;
    real_ref scale;
    cudaStream_t stream;

    bool include(int32_t) const { return true; }
    int64_t numel(int32_t i) const { return tensors->tensors[i].numel; }
    bool fits(const scale_meta &, int32_t) const { return true; }
    void clear(scale_meta &) const {}

    void
    fill(scale_meta &m, int32_t slot, int32_t i) const
    {
        m.ptr[slot] = tensors->tensors[i].data;
        m.dtype[slot] = (uint8_t)tensors->tensors[i].dtype;
    }

    tm_status
    launch(const scale_meta &m, int64_t) const
    {
        scale_kernel<<<m.t.num_chunks, TM_BLOCK, 0, stream>>>(m, scale);
        TM_CUDA_CHECK(cudaGetLastError());
        return TM_OK;
    }
};

tm_status
cuda_scale(const tm_tensor_list *tensors, const tm_tensor *scale, const tm_exec *exec)
{
    TM_NVTX_RANGE("cuda_scale");
    cuda_device_guard guard;
    TM_TRY(guard.enter(scale->device_id));
    scale_walk walk;
    walk.tensors = tensors;
    walk.scale = real_ref_of(*scale);
    walk.stream = cuda_stream_of(exec);
    return multi_tensor_apply<scale_meta>(walk, tensors->count);
}
