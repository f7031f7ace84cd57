/*
 * cpu_ops.h -- the CPU backend: the cpu_<op> entry points (same signatures and contract as the
 * tm_<op> functions of titanmac.h, called only after core/ validated every argument) and the
 * table of loop bodies compiled once per instruction set (cpu_generic.c, cpu_avx2.c,
 * cpu_avx512.c) of which cpu_features.c picks one at run time (PyTorch's DispatchStub, ggml's
 * CPU variants).
 *
 * Work is cut into blocks of TM_CPU_BLOCK elements per tensor; threads get contiguous runs of
 * blocks, and every reduction is combined per block in a fixed order, so results never depend
 * on the thread count or the instruction set.
 */
#ifndef TM_CPU_OPS_H
#define TM_CPU_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "../common/tm_cms_finish.h"
#include "../common/tm_cms_surrogate.h"
#include "../common/tm_half.h"
#include "../common/tm_math.h"
#include "../common/tm_tensor.h"
#include "titanmac.h"

/* 1 where the AVX2 and AVX-512 tables exist: x86-64, the one x86 target the build gives ISA
 * flags to (-DTM_CPU_X86=0 builds the layout of other targets here, for testing). */
#ifndef TM_CPU_X86
#if defined(__x86_64__)
#define TM_CPU_X86 1
#else
#define TM_CPU_X86 0
#endif
#endif

/* Elements per block: 16 KiB of float32, so a block of one list sits in L1 while it is reduced,
 * and a thread's share of a list is many blocks. */
#define TM_CPU_BLOCK 4096

/* Below this many elements in a call one thread does it all: starting a parallel region costs
 * microseconds, about what two threads save on 64K elements. */
#define TM_CPU_SERIAL_ELEMS 65536

/* Norm families with a loop of their own; p == 1, 2 and inf avoid pow(). */
typedef enum { CPU_NORM_L1 = 0, CPU_NORM_L2, CPU_NORM_LINF, CPU_NORM_LP } cpu_norm_kind;

/* One call per contiguous run of elements of one tensor; pointers already point at the run.
 * coeffs: a tm_adamw_coeffs, or a tm_adamw_coeffs_f64 for a float64 tensor. vmax is NULL unless
 * amsgrad; g is written only with unscale (the gradient divided by the loss scale). */
typedef void (*cpu_adamw_fn)(void *p, void *g, void *m, void *v, void *vmax, int64_t n,
                             const void *coeffs, int32_t unscale);
/* x *= scale: in double for float64, else by (float)scale in float. */
typedef void (*cpu_scale_fn)(void *x, int64_t n, double scale);
/* Reduced value of one block (n <= TM_CPU_BLOCK): sum |x|^p, or max |x| for CPU_NORM_LINF,
 * with 8 accumulators combined in a fixed order. */
typedef double (*cpu_reduce_fn)(const void *x, int64_t n, cpu_norm_kind kind, double p);
/* 1 when some element of the block is NaN or +-inf. */
typedef int (*cpu_nonfinite_fn)(const void *x, int64_t n);

/* One block of one tensor for the CMS loops (cpu_cms_loops_impl.h): pointers at the block's
 * first element, one per level < c->levels. parts: this block's partial sums, [levels][P]. */
typedef struct {
    void *p;
    const void *g;
    float *m[TM_CMS_MAX_LEVELS], *acc[TM_CMS_MAX_LEVELS];
    float *ema[TM_CMS_MAX_LEVELS], *vsq[TM_CMS_MAX_LEVELS];
    int64_t n;
    tm_dtype dtype;
    int32_t legacy;
    float grad_scale;
    float lr;                          /* apply: lr[group] */
    const tm_cms_consts *c;
    const tm_cms_direct_net *net;      /* DIRECT */
    const tm_cms_level_out *lv;        /* [levels] of this tensor: LEGACY a, b (update); apply */
    const tm_cms_tensor_out *tv;       /* apply */
    float shift_m[TM_CMS_MAX_LEVELS];  /* LEGACY stats: m_l[0] and g^_l[0] of the tensor */
    float shift_g[TM_CMS_MAX_LEVELS];
    double *parts;
} cpu_cms_block;

/* One block of one tensor for the surrogate loops (tm_cms_surrogate, cpu_cms_surrogate.c):
 * pointers at the block's first element. */
typedef struct {
    const void *target; /* g = target * scale / divisor */
    const float *m;
    float *out;         /* the previous output in (has_prev), this one out (gradient pass) */
    int64_t n;
    tm_dtype dtype;     /* the target's */
    int32_t has_prev;
    float scale, divisor;
    float coef_o, coef_g, coef_t; /* gradient pass: d loss / d o = co o + cg g + ct (o - prev) */
    const tm_cms_direct_net *net;
    const float *w_hid_t; /* [L - 1][20][20]: each hidden layer's W^T (the backward) */
    double *parts;      /* the block's TM_SUR_NORM_PARTS sums, then its gradient partials */
} cpu_sur_block;

/* The surrogate's blocks are the CPU's: element e of a block is its lane e % 8 on both backends
 * (tm_cms_surrogate.h). */
_Static_assert(TM_SUR_BLOCK == TM_CPU_BLOCK, "the surrogate's blocks are the CPU's blocks");

/* The CMS passes over one block (cpu_cms.c and cpu_cms_surrogate.c have the pass structure). */
typedef struct {
    void (*stats)(const cpu_cms_block *b);  /* LEGACY pass S: shifted sums of m and g^ */
    void (*update)(const cpu_cms_block *b); /* pass A: accumulate, g^, e, v, m', sums */
    void (*apply)(const cpu_cms_block *b);  /* pass B: clamp, contributions, p */
    void (*sur_gsq)(const cpu_sur_block *b);   /* surrogate: sum g^2 */
    void (*sur_norms)(const cpu_sur_block *b); /* surrogate: o, the four sums */
    void (*sur_grads)(const cpu_sur_block *b); /* surrogate: o out, sums of o^2, (o - prev)^2,
                                                  the weights' gradient */
} cpu_cms_kernels;

/* The loop bodies of one instruction set, indexed by tm_dtype. */
typedef struct {
    const char *name;
    const cpu_cms_kernels *cms;
    cpu_adamw_fn adamw[TM_DTYPE_COUNT];
    cpu_scale_fn scale[TM_DTYPE_COUNT];
    cpu_reduce_fn reduce[TM_DTYPE_COUNT];
    cpu_nonfinite_fn nonfinite[TM_DTYPE_COUNT];
} cpu_kernels;

extern const cpu_kernels cpu_kernels_generic;
#if TM_CPU_X86
extern const cpu_kernels cpu_kernels_avx2;
extern const cpu_kernels cpu_kernels_avx512;
#endif

/* cpu_features.c: the table in use (never NULL), and choosing it. */
const cpu_kernels *cpu_active_kernels(void);
tm_status cpu_select_isa(const char *name);

/* max that keeps NaN from either side (torch.maximum), for combining inf-norm partials. */
static inline double
cpu_max_nan(double a, double b)
{
    return (b > a || b != b) ? b : a;
}

/* cpu_ops.c / cpu_norms.c / cpu_dno.c / cpu_cms.c: the drivers. */
size_t cpu_norms_scratch_bytes(const tm_tensor_list *grads, const tm_tensor_list *params);
tm_status cpu_norms(const tm_tensor_list *grads, const tm_tensor_list *params,
                    const tm_norms_args *args, const tm_norms_out *out, const tm_exec *exec);
tm_status cpu_clip_coef(const tm_tensor *total_norm, double max_norm, const tm_tensor *coef,
                        const tm_exec *exec);
tm_status cpu_scale(const tm_tensor_list *tensors, const tm_tensor *scale, const tm_exec *exec);
tm_status cpu_adamw_step(const tm_adamw_tensors *t, const tm_adamw_args *args,
                         const tm_adamw_inputs *in, const tm_exec *exec);
size_t cpu_cms_scratch_bytes(const tm_tensor_list *params, int32_t levels, tm_cms_net net);
tm_status cpu_cms_step(const tm_cms_tensors *t, const tm_cms_args *args, const tm_cms_inputs *in,
                       const tm_exec *exec);
size_t cpu_cms_surrogate_scratch_bytes(const tm_tensor_list *targets, int32_t layers);
tm_status cpu_cms_surrogate(const tm_cms_surrogate_tensors *t, const tm_cms_surrogate_args *args,
                            const tm_cms_surrogate_inputs *in, const tm_exec *exec);
tm_status cpu_dno_control(const tm_dno_control_tensors *t, const tm_dno_control_args *args,
                          const tm_exec *exec);

/* A run of blocks [block_begin, block_end) of tensor `tensor`; global_block is the index of
 * block_begin among all blocks of the call (where its partials go in scratch). */
typedef void (*cpu_segment_fn)(void *ctx, int32_t tensor, int64_t block_begin, int64_t block_end,
                               int64_t global_block);

/* Blocks of one tensor; 0 for numel <= 0, so scratch sizing of unvalidated lists stays sane. */
static inline int64_t
cpu_blocks_of(int64_t numel)
{
    return numel > 0 ? (numel + TM_CPU_BLOCK - 1) / TM_CPU_BLOCK : 0;
}

/* Element offset (*offset) and count (returned) of blocks [b0, b1) of a tensor of numel. */
static inline int64_t
cpu_segment_elems(int64_t numel, int64_t b0, int64_t b1, int64_t *offset)
{
    int64_t end = b1 * TM_CPU_BLOCK < numel ? b1 * TM_CPU_BLOCK : numel;
    *offset = b0 * TM_CPU_BLOCK;
    return end - *offset;
}

/* Address of element `offset` of t (dtype already validated). */
static inline void *
cpu_elem_ptr(const tm_tensor *t, int64_t offset)
{
    return (char *)t->data + (size_t)offset * tm_dtype_size(t->dtype);
}

/* Element i of a float32 or float64 tensor (validated) in host memory: tm_real_load /
 * tm_real_store (tm_math.h) on a tm_tensor. */
static inline double
cpu_read_real(const tm_tensor *t, int64_t i)
{
    return tm_real_load(t->data, t->dtype == TM_FLOAT64, i);
}

static inline void
cpu_store_real(const tm_tensor *t, int64_t i, double value)
{
    tm_real_store(t->data, t->dtype == TM_FLOAT64, i, value);
}

/* value as a tensor of dtype holds it, widened back (exactly): a float16 or bfloat16 one rounded
 * to float first, then to nearest even, as torch's .to() of a float32 norm rounds it; float32
 * and float64 leave it as it is (the norms are stored in those before this is asked). */
static inline double
cpu_round_to(double value, tm_dtype dtype)
{
    if (dtype == TM_FLOAT16) {
        return tm_f16_to_f32(tm_f32_to_f16((float)value));
    }
    if (dtype == TM_BFLOAT16) {
        return tm_bf16_to_f32(tm_f32_to_bf16((float)value));
    }
    return value;
}

/* Element 0 of a one-element tensor of any dtype (validated), exactly, as a double. */
static inline double
cpu_read_scalar(const tm_tensor *t)
{
    if (t->dtype == TM_FLOAT16) {
        return tm_f16_to_f32(*(const uint16_t *)t->data);
    }
    if (t->dtype == TM_BFLOAT16) {
        return tm_bf16_to_f32(*(const uint16_t *)t->data);
    }
    return cpu_read_real(t, 0);
}

/* out[q] = sum over nb blocks of part q, block b's parts at first[b * stride], in block order:
 * how every per-block partial becomes a tensor's (or a call's) sum, independent of the threads
 * that wrote the blocks. */
static inline void
cpu_sum_blocks(const double *first, int64_t stride, int64_t nb, int64_t count, double *out)
{
    for (int64_t q = 0; q < count; q++) {
        out[q] = 0.0;
    }
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t q = 0; q < count; q++) {
            out[q] += first[b * stride + q];
        }
    }
}

/* Blocks of all tensors of lead, in order. */
int64_t cpu_count_blocks(const tm_tensor_list *lead);

/* Calls fn over every block of lead, spread over exec->num_threads threads (one when the call is
 * small); each thread gets one contiguous range of global block indices. */
void cpu_for_each_block(const tm_tensor_list *lead, const tm_exec *exec, cpu_segment_fn fn,
                        void *ctx);

#endif /* TM_CPU_OPS_H */
