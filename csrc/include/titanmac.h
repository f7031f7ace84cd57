/*
 * titanmac.h -- the public C API of titanmac_c: the types every op shares (titanmac_base.h), the
 * CMS ops (titanmac_cms.h) and the others, declared here; including this file gives all of it.
 *
 * The inside of an optimizer step as a few fused passes over lists of tensors:
 *   tm_norms       per-group and global p-norms of gradients (and of parameters) + non-finite flag
 *   tm_clip_coef   coef = min(1, max_norm / (total_norm + 1e-6)), torch's clip_grad_norm_ formula,
 *                  from the norm as the caller returns it (in the gradients' dtype)
 *   tm_scale       x *= *scale for every tensor of a list (the eager half of clip_grad_norm_)
 *   tm_adamw_step  AdamW (decoupled weight decay, bias correction, amsgrad, maximize) with a
 *                  per-group learning rate, an optional gradient scale multiplied in as each
 *                  gradient is loaded, and an optional skip flag
 *   tm_dno_control the DeepNestedOptimizer's control step (loss EMA, controller, lr, clip, skip)
 *   tm_cms_step    the DeepNestedOptimizer's CMS update (multi-level momentum, learned MLP)
 *   tm_cms_surrogate  the gradient of its DirectUpdateMLP's surrogate loss (CMS Phase 1; CPU)
 *
 * Every scalar a step may need to change without the host looking (learning rates, step counts,
 * gradient scale, skip flag, norms) lives in tensor memory on the tensors' device, so a CUDA step
 * can be captured in a graph. Host-side hyperparameters (betas, eps, weight decay, norm type) are
 * plain numbers.
 *
 * Contract (shaped like TransformerEngine's common/ API):
 *   - every function returns tm_status; details of the last failure on this thread come from
 *     tm_last_error(). Nothing prints, exits or aborts.
 *   - every input is validated before the first write: a failing call changes no tensor.
 *   - no tensor a call writes (nor its scratch) may share memory with another tensor of the
 *     call (TM_ERR_VALUE "x: shares memory with y"); tensors a call only reads may share.
 *   - the library allocates no device memory and nothing that outlives a call: scratch is passed
 *     in (tm_exec), sized by *_scratch_bytes(); only the memory-sharing check takes host memory
 *     (a span and two sort keys per tensor) while it runs.
 *   - no CUDA or Python types appear here; a stream is a void *.
 */
#ifndef TITANMAC_H
#define TITANMAC_H

#include <stddef.h>
#include <stdint.h>

#include "titanmac_base.h"
#include "titanmac_cms.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- norms ---- */

typedef struct {
    double norm_type;         /* p > 0, or INFINITY for max |x| */
    int32_t num_groups;       /* >= 1 */
    const int32_t *group_of;  /* host [grads.count], values in [0, num_groups); NULL = all 0 */
    double max_norm;          /* finite, >= 0; read only when out->coef is wanted */
    tm_dtype result_dtype;    /* the dtype the caller returns total_grad in, read only when
                                 out->coef is wanted: TM_FLOAT16 or TM_BFLOAT16 -> the coefficient
                                 is that of total_grad rounded to it (to float first), the norm
                                 the caller returns, as torch's clip_grad_norm_ computes it from
                                 the norm in the gradients' dtype (a float16 norm past 65504 is
                                 inf, which clips to 0); TM_FLOAT32 (0, the default) or
                                 TM_FLOAT64 -> of total_grad as stored. total_grad is written
                                 unrounded either way. */
} tm_norms_args;

/* Outputs on the tensors' device, each float32 or float64 (written in its own dtype: float64
 * keeps a float64 input's norm unrounded); data == NULL, numel == 0: not wanted (optional). */
typedef struct {
    tm_tensor group_grad;  /* [num_groups] p-norm of the grads of each group (0 for an empty one) */
    tm_tensor group_param; /* [num_groups] p-norm of the params of each group; optional */
    tm_tensor total_grad;  /* [1] p-norm over all grads */
    tm_tensor total_param; /* [1] p-norm over all params; optional */
    tm_tensor nonfinite;   /* [1] 1.0f when any grad element is NaN or +-Inf, else 0.0f (float64
                              grads with p = 1, 2: also when the sum overflows, where torch's
                              norm is inf too); optional */
    tm_tensor coef;        /* [1] the clip coefficient of total_grad (rounded to
                              args->result_dtype), exactly as tm_clip_coef computes it from that
                              value, written by the same finishing step (one launch fewer on
                              CUDA); optional */
} tm_norms_out;

/* Scratch the caller must pass to tm_norms for these lists (0 for none needed). */
size_t tm_norms_scratch_bytes(const tm_tensor_list *grads, const tm_tensor_list *params);

/* One pass over grads (and params when params != NULL and params->count > 0) giving per-group
 * and global p-norms. Norms of NaN-containing data are NaN, as in torch. The result does not
 * depend on the thread count: partial sums per fixed block are combined in index order.
 * \param[in]  grads   tensors to reduce (read only)
 * \param[in]  params  NULL, or a list of the same count and numels as grads (read only)
 * \param[in]  args    norm type and grouping
 * \param[out] out     result tensors (float32 or float64)
 * \param[in]  exec    stream, threads, scratch */
tm_status tm_norms(const tm_tensor_list *grads, const tm_tensor_list *params,
                   const tm_norms_args *args, const tm_norms_out *out, const tm_exec *exec);

/* ---------------------------------------------------------------- clipping ---- */

/* coef[0] = min(1, max_norm / (total_norm[0] + 1e-6)) in the arithmetic of coef's dtype (float32:
 * the norm rounded to float first; float64: double, torch's arithmetic for a float64 norm),
 * evaluated as torch's clip_grad_norm_ evaluates it (reciprocal of norm + 1e-6, times max_norm,
 * clamp at 1). A NaN norm gives a NaN coefficient, as in torch. total_norm is the norm as the
 * caller returns it: a float16 or bfloat16 one (the gradients' dtype) is read as its value, so
 * that the coefficient is the one of the norm returned (an infinite one gives 0, or NaN for an
 * infinite max_norm, as torch's).
 * \param[in]  total_norm  float32, float64, float16 or bfloat16 [1]
 * \param[in]  max_norm    finite, >= 0
 * \param[out] coef        float32 or float64 [1], same device */
tm_status tm_clip_coef(const tm_tensor *total_norm, double max_norm, const tm_tensor *coef,
                       const tm_exec *exec);

/* tensors[i] *= scale[0] for every i: a float64 tensor in double, the others by the factor
 * rounded to float32 (torch casts the clip coefficient to each gradient's dtype) in float32
 * math, rounded once to the tensor dtype.
 * \param[in,out] tensors  writable tensors
 * \param[in]     scale    float32 or float64 [1] on the same device */
tm_status tm_scale(const tm_tensor_list *tensors, const tm_tensor *scale, const tm_exec *exec);

/* ---------------------------------------------------------------- AdamW ---- */

/* Host hyperparameters of one parameter group. */
typedef struct {
    double beta1;        /* [0, 1) */
    double beta2;        /* [0, 1) */
    double eps;          /* finite, >= 0 */
    double weight_decay; /* finite, >= 0; decoupled: p *= 1 - lr * weight_decay */
    int32_t maximize;    /* nonzero: ascend (grad is negated) */
} tm_adamw_group;

typedef struct {
    int32_t amsgrad;              /* nonzero: keep max_exp_avg_sq, its sqrt in the denominator */
    int32_t zero_grads_on_skip;   /* nonzero: when skip is set, zero every grad instead (grads must
                                     then be writable); the DeepNestedOptimizer's NaN guard */
    int32_t num_groups;           /* >= 1 */
    const tm_adamw_group *groups; /* host array [num_groups] */
    const int32_t *group_of;      /* host array [params.count]; NULL = all in group 0 */
} tm_adamw_args;

/* One entry per parameter; every list has params.count tensors of equal numel, except step
 * (numel 1 each) and max_exp_avg_sq (count 0 unless amsgrad). grads, exp_avg, exp_avg_sq and
 * max_exp_avg_sq have the dtype of their param (float64 ones are computed in double) and its
 * shape where both shapes are given (a state made for a (4, 6) param does not step it reshaped
 * to (6, 4)); step is float32. Only grads may be read-only. */
typedef struct {
    tm_tensor_list params;
    tm_tensor_list grads;
    tm_tensor_list exp_avg;
    tm_tensor_list exp_avg_sq;
    tm_tensor_list max_exp_avg_sq;
    tm_tensor_list step;
} tm_adamw_tensors;

/* Per-step inputs read from device memory. */
typedef struct {
    tm_tensor lr;         /* float32 or float64 [num_groups] learning rate of each group (a
                             float64 one reaches float64 params unrounded, as torch's float) */
    tm_tensor grad_scale; /* float32 or float64 [1] multiplied into each grad as it is loaded
                             (rounded to float32 for all but float64 grads); optional */
    tm_tensor skip;       /* float32 [1]; when nonzero the call changes nothing (but zeroes the
                             grads with zero_grads_on_skip); optional */
    tm_tensor loss_scale; /* float32 [1], optional: torch.amp's loss scale, which the grads
                             still carry. Each grad is divided by it as it is loaded (after
                             grad_scale), and a step not skipped stores that unscaled value back
                             into the grad, as torch's fused AdamW does under GradScaler. The
                             grads must then be writable and disjoint, and lr, grad_scale, skip
                             and loss_scale must not lie inside one. */
} tm_adamw_inputs;

/* Scratch the caller must pass to tm_adamw_step (0 on the CPU). On CUDA it holds a completion
 * counter: it must be zero before its first use, and every call leaves it zero again. */
size_t tm_adamw_scratch_bytes(const tm_adamw_tensors *t);

/* One AdamW step, the math of torch.optim.AdamW (per tensor: step += 1, then
 *   g  = grad * grad_scale [/ loss_scale, then stored back into grad], negated if maximize
 *   p *= 1 - lr * wd
 *   m  = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
 *   denom = sqrt(amsgrad ? (vmax = max(vmax, v)) : v) / sqrt(1 - beta2^step) + eps
 *   p -= lr / (1 - beta1^step) * m / denom),
 * element math in float32 (double for float64 tensors), bias corrections in double. */
tm_status tm_adamw_step(const tm_adamw_tensors *t, const tm_adamw_args *args,
                        const tm_adamw_inputs *in, const tm_exec *exec);

/* ---------------------------------------------------------------- DeepNestedOptimizer ---- */

/* Bounds of the controller: the CUDA kernel runs one block with one thread per hidden unit (at
 * most 1,024 threads) and keeps two activation rows in shared memory, and it takes every weight
 * pointer as a kernel parameter (2 * (layers + 1) of them, under 4 KB). The CPU loop keeps the
 * same two rows on its stack. */
#define TM_DNO_MAX_HIDDEN 1024
#define TM_DNO_MAX_LAYERS 128

/* Host settings of one DeepNestedOptimizer control step (spec deep_nested_optimizer.md 3-6). */
typedef struct {
    int32_t num_groups;      /* G >= 1 */
    int32_t hidden;          /* controller width H, 1..TM_DNO_MAX_HIDDEN */
    int32_t layers;          /* controller hidden layers L, 1..TM_DNO_MAX_LAYERS */
    int32_t update_controller; /* nonzero: stats + controller run (t % F_c == 0 or t == 1) */
    int32_t first_step;      /* nonzero when t == 1: the EMA starts at the loss */
    int32_t check_loss;      /* nonzero: a non-finite loss[0] skips the step (device-side guard) */
    double base_lr;          /* lr[g] = base_lr * mu[g]; base_lr * mu_max must fit float32 */
    double max_grad_norm;    /* > 0: clip coefficient, NaN-gradient guard; <= 0: coef 1, none */
    double ema_beta;         /* 0.1: ema = (1 - beta) * ema + beta * loss */
    double mu_min, mu_max;   /* 0.1, 2.0 */
} tm_dno_control_args;

/* Tensors of a control step, all float32 on one device. */
typedef struct {
    tm_tensor group_grad;  /* in  [G] pre-clip gradient norm per group (tm_norms)            */
    tm_tensor group_param; /* in  [G] parameter norm per group (read when update_controller) */
    tm_tensor total_grad;  /* in  [1] pre-clip global gradient norm (read when clipping)      */
    tm_tensor depths;      /* in  [G] group depths (stats column 2)                           */
    tm_tensor loss;        /* in  [1] the step's loss                                         */
    tm_tensor_list weights; /* in controller Linear weights/biases in order: W0 [H,3], b0 [H],
                               (W_i [H,H], b_i [H]) x (L-1), W_out [1,H], b_out [1]          */
    tm_tensor mu;          /* in/out [G] lr multipliers; rewritten on controller steps        */
    tm_tensor ema;         /* in/out [2] EMA of the loss (both entries equal)                 */
    tm_tensor lr;          /* out [G] base_lr * mu                                            */
    tm_tensor coef;        /* out [1] clip coefficient for tm_adamw_step's grad_scale         */
    tm_tensor skip;        /* out [1] 1.0f when the loss (check_loss) or the clipped norm is
                              non-finite, else 0.0f: tm_adamw_step's skip                     */
    tm_tensor previous;    /* out [2G + 4] optional: mu, ema, lr, coef and skip as they were
                              before this call, so that a caller can undo the step when a later
                              call refuses it */
} tm_dno_control_tensors;

/* One fused control step, the spec's order: a non-finite loss skips everything (mu, ema
 * unchanged); else ema update; on controller steps S[g] = (grad norm, param norm, depth) with
 * non-finite norms replaced by 1.0, r = MLP(S[g]) (Linear/ReLU stack), mu = clamp(mu_min +
 * (mu_max - mu_min) * sigmoid(r), mu_min, mu_max), a non-finite mu -> 1.0; then lr = base_lr *
 * mu; clip coef = min(1, max_grad_norm / (total + 1e-6)) and a non-finite total sets skip.
 * One thread of work: it runs as a single tiny kernel on CUDA, so no value visits the host. */
tm_status tm_dno_control(const tm_dno_control_tensors *t, const tm_dno_control_args *args,
                         const tm_exec *exec);

/* ---------------------------------------------------------------- backends ---- */

/* Pick the CPU loop bodies once (called at module load). name: NULL or "" = best the CPU
 * supports, or one of "generic", "avx2", "avx512"; TM_ERR_VALUE if unknown or unsupported. */
tm_status tm_cpu_select_isa(const char *name);

/* Name of the CPU instruction set in use: "generic", "avx2" or "avx512". */
const char *tm_cpu_isa(void);

/* 1 when this build has the CUDA backend compiled in (says nothing about a device being there). */
int tm_cuda_compiled(void);

#ifdef __cplusplus
}
#endif

#endif /* TITANMAC_H */
