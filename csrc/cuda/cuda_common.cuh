/*
 * cuda_common.cuh -- what every CUDA op file shares: the error macro that records through
 * tm_set_error, the device guard, the stream mapping, the launch geometry constants, 16-byte
 * vectors, dtype conversions (float math for float32, float16, bfloat16; double for float64),
 * float32-or-float64 scalars, and deterministic warp/block reductions.
 *
 * Adapted from llm.c llmc/cuda_common.h (cudaCheck, minus the exit: we return a tm_status) and
 * from apex / PyTorch multi-tensor code (device guard around launches, 512 threads per block,
 * 65,536 elements per chunk).
 */
#ifndef TM_CUDA_COMMON_CUH
#define TM_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "titanmac.h"
#include "tm_math.h"
#include "tm_status.h"

/* ---------------------------------------------------------------- constants ---- */

#define TM_BLOCK 512       /* threads per block of the multi-tensor kernels */
#define TM_CHUNK 65536     /* elements of one tensor handled by one block (PyTorch, apex) */
#define TM_ILP 4           /* 16-byte loads a thread issues before using any (norms, scale) */
#define TM_VEC_BYTES 16    /* widest plain global load/store: LDG.128 / STG.128 */
#define TM_MAX_GRID_X 2147483647LL /* gridDim.x limit, hence chunks per launch */
#define TM_MIN_BLOCKS 2    /* AdamW's blocks per SM: caps it at 64 registers, so 32 warps of loads
                              are in flight per SM rather than 16. ptxas (CUDA 13) spills a few
                              bytes of the float32 amsgrad and float64 kernels at this cap (up to
                              168 B for float64 amsgrad); one block per SM removes the spills for
                              float64 but halves the loads in flight: untimed on a GPU yet */

static_assert(TM_BLOCK % 32 == 0 && TM_BLOCK <= 1024, "whole warps, one block");
/* Chunk c of a tensor starts c * TM_CHUNK elements (of 2, 4 or 8 bytes) in: a 16-aligned tensor
 * has 16-aligned chunks, so one alignment test per tensor decides the vector path. */
static_assert((TM_CHUNK * 2) % TM_VEC_BYTES == 0, "chunk starts keep 16-byte alignment");

/* Kernel parameter space. CUDA 12.1 raised the limit from 4,096 to 32,764 bytes on Volta and
 * newer (every target here is sm_75+); the driver must be r530 or newer, which a CUDA 13 runtime
 * requires anyway. 8x the room means ~1,000 tensors per launch instead of ~110. A build for an
 * older driver can pass -DTM_KERNEL_PARAM_BYTES=4096; the static_asserts then size every table
 * for 4 KB. */
#ifndef TM_KERNEL_PARAM_BYTES
#if CUDART_VERSION >= 12010
#define TM_KERNEL_PARAM_BYTES 32764
#else
#define TM_KERNEL_PARAM_BYTES 4096
#endif
#endif

/* ---------------------------------------------------------------- errors ---- */

/* if expr is not cudaSuccess, record "file:line: expr: name: message" and return TM_ERR_CUDA. */
#define TM_CUDA_CHECK(expr)                                                                        \
    do {                                                                                           \
        const cudaError_t tm_cuda_err_ = (expr);                                                   \
        if (tm_cuda_err_ != cudaSuccess) {                                                         \
            return tm_set_error(TM_ERR_CUDA, __FILE__, __LINE__, "%s: %s: %s", #expr,              \
                                cudaGetErrorName(tm_cuda_err_),                                    \
                                cudaGetErrorString(tm_cuda_err_));                                 \
        }                                                                                          \
    } while (0)

/* ---------------------------------------------------------------- device, stream ---- */

/* Makes the tensors' device current while it lives and gives the caller's device back on every
 * return path (apex's DeviceGuard): the tensors may be on cuda:1 while this thread has cuda:0
 * current, and launching on the wrong device fails (or worse, with a NULL stream, succeeds). */
struct cuda_device_guard {
    int prev = -1; /* device to restore; -1: nothing was changed */

    cuda_device_guard() = default;
    cuda_device_guard(const cuda_device_guard &) = delete;
    cuda_device_guard &operator=(const cuda_device_guard &) = delete;

    tm_status
    enter(int32_t device)
    {
        int cur = -1;
        TM_CUDA_CHECK(cudaGetDevice(&cur));
        if (cur != device) {
            TM_CUDA_CHECK(cudaSetDevice(device));
            prev = cur;
        }
        return TM_OK;
    }

    /* Restoring a device that was current a moment ago does not fail in practice; a destructor
     * could not report it anyway. */
    ~cuda_device_guard()
    {
        if (prev >= 0) {
            (void)cudaSetDevice(prev);
        }
    }
};

/* exec->stream NULL means the legacy default stream, named explicitly so that a build with
 * --default-stream per-thread still means what the header promises. */
static inline cudaStream_t
cuda_stream_of(const tm_exec *exec)
{
    return exec->stream != NULL ? (cudaStream_t)exec->stream : cudaStreamLegacy;
}

/* ---------------------------------------------------------------- elements ---- */

/* 16 bytes of T (2 float64, 4 float32, 8 float16 or bfloat16 elements), loaded and stored as one
 * LDG.128 / STG.128 when the address is 16-aligned. */
template <typename T> struct alignas(TM_VEC_BYTES) vec16 {
    T v[TM_VEC_BYTES / sizeof(T)];
};

static __device__ __forceinline__ bool
is_aligned16(const void *p)
{
    return ((uintptr_t)p & (TM_VEC_BYTES - 1)) == 0;
}

/* The type an element is computed in (tm_math.h): double for float64, float for the others. */
template <typename T> using real_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

/* Element <-> its compute type. Widening is exact; narrowing rounds to nearest even, as torch
 * does. A float64 element is never routed through float: to_float(double) and
 * from_float<double> are deleted, so such a slip does not compile; to_real / from_real and
 * to_wide are the generic forms. */
static __device__ __forceinline__ float
to_float(float x)
{
    return x;
}

static __device__ __forceinline__ float
to_float(__half x)
{
    return __half2float(x);
}

static __device__ __forceinline__ float
to_float(__nv_bfloat16 x)
{
    return __bfloat162float(x);
}

static __device__ float to_float(double x) = delete;

template <typename T> static __device__ __forceinline__ T from_float(float x);

template <>
__device__ __forceinline__ float
from_float<float>(float x)
{
    return x;
}

template <>
__device__ __forceinline__ __half
from_float<__half>(float x)
{
    return __float2half_rn(x);
}

template <>
__device__ __forceinline__ __nv_bfloat16
from_float<__nv_bfloat16>(float x)
{
    return __float2bfloat16_rn(x);
}

template <> __device__ double from_float<double>(float x) = delete;

template <typename T>
static __device__ __forceinline__ real_t<T>
to_real(T x)
{
    if constexpr (std::is_same_v<T, double>) {
        return x;
    } else {
        return to_float(x);
    }
}

template <typename T>
static __device__ __forceinline__ T
from_real(real_t<T> x)
{
    if constexpr (std::is_same_v<T, double>) {
        return x;
    } else {
        return from_float<T>(x);
    }
}

/* Any element as a double, exactly (the norms accumulate in double). */
template <typename T>
static __device__ __forceinline__ double
to_wide(T x)
{
    return (double)to_real(x);
}

/* ---------------------------------------------------------------- real scalars ---- */

/* A tensor that may be float32 or float64 (validated): norm outputs, clip coefficients, scale
 * factors, learning rates, grad scales. Carrying the dtype with the pointer means 8 bytes are never
 * read or written as 4. */
struct real_ref {
    void *ptr; /* NULL: not given */
    bool f64;  /* float64, else float32 */
};

static inline real_ref
real_ref_of(const tm_tensor &t)
{
    return real_ref{t.data, t.dtype == TM_FLOAT64};
}

/* tm_math.h's tm_real_load / tm_real_store / tm_real_store_clip_coef (shared with the CPU) on a
 * real_ref: element i as a double (exact), element i = value rounded once to the dtype, coef[0] =
 * the clip coefficient of total_norm in the arithmetic of coef's dtype. */
static __device__ __forceinline__ double
load_real(real_ref x, int64_t i)
{
    return tm_real_load(x.ptr, x.f64, i);
}

static __device__ __forceinline__ void
store_real(real_ref x, int64_t i, double value)
{
    tm_real_store(x.ptr, x.f64, i, value);
}

static __device__ __forceinline__ void
store_clip_coef(real_ref coef, double total_norm, double max_norm)
{
    tm_real_store_clip_coef(coef.ptr, coef.f64, total_norm, max_norm);
}

/* value as a tensor of dtype holds it, widened back (exactly): float16 and bfloat16 rounded to
 * float first, then to nearest even (overflow: inf), as the CPU's cpu_round_to and torch's .to();
 * float32 and float64 as it is (the norms are stored in those before this is asked). */
static __device__ __forceinline__ double
round_to_dtype(double value, tm_dtype dtype)
{
    if (dtype == TM_FLOAT16) {
        return (double)__half2float(__float2half_rn((float)value));
    }
    if (dtype == TM_BFLOAT16) {
        return (double)__bfloat162float(__float2bfloat16_rn((float)value));
    }
    return value;
}

/* Element 0 of a one-element tensor of any dtype, exactly, as a double. */
static __device__ __forceinline__ double
load_scalar(const void *ptr, tm_dtype dtype)
{
    if (dtype == TM_FLOAT16) {
        return (double)__half2float(*(const __half *)ptr);
    }
    if (dtype == TM_BFLOAT16) {
        return (double)__bfloat162float(*(const __nv_bfloat16 *)ptr);
    }
    return tm_real_load(ptr, dtype == TM_FLOAT64, 0);
}

/* ---------------------------------------------------------------- reductions ---- */

/* Tree over the 32 lanes; lane 0 holds the result. The shape of the tree is fixed, so the bits
 * are the same on every run (no atomics anywhere in a reduction). */
template <typename Op>
static __device__ __forceinline__ double
warp_reduce(double v, Op op)
{
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = op(v, __shfl_down_sync(0xffffffffu, v, offset));
    }
    return v;
}

/* Whole-block reduction, result in thread 0; every thread must call it. 0.0 must be neutral for
 * op (true of sums and of max |x|). Warps are combined in warp order, so it is deterministic. */
template <typename Op>
static __device__ __forceinline__ double
block_reduce(double v, Op op)
{
    __shared__ double s_warp[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    v = warp_reduce(v, op);
    if (lane == 0) {
        s_warp[warp] = v;
    }
    __syncthreads();
    v = 0.0;
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? s_warp[lane] : 0.0;
        v = warp_reduce(v, op);
    }
    __syncthreads(); /* s_warp is free again for a second call */
    return v;
}

#endif /* TM_CUDA_COMMON_CUH */
