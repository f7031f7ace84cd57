/*
 * titanmac_cms.h -- the CMS ops of the C API (titanmac.h includes this file): the
 * DeepNestedOptimizer's CMS update (Phase 2, tm_cms_step) and its DirectUpdateMLP's surrogate
 * training gradient (Phase 1, tm_cms_surrogate), docs/deep_nested_optimizer.md section 7. The
 * contract of titanmac.h holds for both. Section numbers (spec N) and bug ids (B1-B11, its section
 * 14) refer to that document.
 */
#ifndef TITANMAC_CMS_H
#define TITANMAC_CMS_H

#include <stddef.h>
#include <stdint.h>

#include "titanmac_base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- CMS update ---- */

#define TM_CMS_MAX_LEVELS 4
#define TM_CMS_MAX_LAYERS 8          /* L: Linear+SiLU pairs of a momentum network */
#define TM_CMS_DIRECT_MAX_HIDDEN 20  /* DirectUpdateMLP: H = min(momentum_hidden_dim, 20) */
#define TM_CMS_LEGACY_MAX_HIDDEN 256 /* L2RegressionMomentum */

/* The momentum network of the CMS path (spec deep_nested_optimizer.md 7.3). */
typedef enum {
    TM_CMS_DIRECT = 0, /* DirectUpdateMLP: per element, contribution = the MLP's output */
    TM_CMS_LEGACY = 1  /* L2RegressionMomentum: per tensor (a, b, d), contribution m (1 - d) */
} tm_cms_net;

/* Host settings of one CMS Phase-2 call; arrays are indexed by level l < levels. */
typedef struct {
    int32_t levels;                       /* K in [1, TM_CMS_MAX_LEVELS] */
    int32_t fires[TM_CMS_MAX_LEVELS];     /* nonzero: level l fires now (t % f_l == 0) */
    double divisors[TM_CMS_MAX_LEVELS];   /* max(cms_frequencies[l], 1): g^ = A_l / it (B7) */
    double ema_decays[TM_CMS_MAX_LEVELS]; /* d_l = 0.99 ** (1 / f_l), in [0, 1] */
    double beta2;                         /* v_sq decay, 0.999 */
    double momentum_coef;                 /* DIRECT: m' = coef m + (1 - coef) delta, 0.9 */
    double clamp_ratio;                   /* ||m'|| <= ratio * max(||g^||, 1e-8), 100 */
    double weight_decay;                  /* >= 0; u += wd * p when > 0 */
    double t;                             /* the step number (LEGACY context t / 1000) */
    double base_lr;                       /* LEGACY context; both unless in->context given */
    tm_cms_net net;
    int32_t hidden;                       /* H: DIRECT <= 20, LEGACY <= 256 */
    int32_t layers;                       /* L in [1, 8]: Linear+SiLU pairs before the output */
    int32_t num_groups;                   /* G >= 1 */
    const int32_t *group_of;              /* host [params.count] in [0, G); NULL = all 0 */
} tm_cms_args;

/* One entry per tensor. State lists are per level: momentum[l] is the list of m_l of every
 * tensor, named "momentum[l]" in messages ("momentum[1][3]" = level 1 of tensor 3). Every state
 * tensor is float32 with its param's numel; grads have the params' dtype (fp32, bf16, fp16, fp64);
 * grads and state have the param's shape where both shapes are given (tm_tensor).
 * step_counts[i] is float32 with `levels` elements: element l counts level l's firings. weights
 * are the network's parameters in module order (list(net.parameters())): DIRECT W_in [H,4],
 * b_in, (W [H,H], b) x (L-1), W_out [1,H], b_out [1]; LEGACY residual_weight [1] first (never
 * read: forward does not use it), then W_in [H,9], b_in, (W [H,H], b) x (L-1), W_out [3,H],
 * b_out [3]. Lists of levels >= levels are ignored. An ema[l] or v_sq[l] list may be empty
 * (count 0): that buffer is not kept, its update is computed and dropped. Nothing in the update
 * reads them (the reference reads only e_0, in its meta proxy loss, outside this op), so a
 * caller keeps 2 levels + 1 buffers per tensor instead of 4 levels. */
typedef struct {
    tm_tensor_list params;
    tm_tensor_list grads;
    tm_tensor_list momentum[TM_CMS_MAX_LEVELS];
    tm_tensor_list accumulated[TM_CMS_MAX_LEVELS];
    tm_tensor_list ema[TM_CMS_MAX_LEVELS];
    tm_tensor_list v_sq[TM_CMS_MAX_LEVELS];
    tm_tensor_list step_counts;
    tm_tensor_list weights;
} tm_cms_tensors;

/* Zero-initialise it: a tensor left zeroed is one not given (tm_tensor_given). */
typedef struct {
    tm_tensor lr;         /* float32 [G]: base_lr * mu_g */
    tm_tensor grad_scale; /* float32 [1], the clip coefficient (the reference accumulates the
                             clipped gradient, rounded to the grad dtype); optional (= 1) */
    tm_tensor skip;       /* float32 [1]; nonzero: the call changes nothing; optional */
    tm_tensor loss;       /* float32 [1]: the LEGACY context's loss; optional for DIRECT */
    tm_tensor context;    /* float64 [2] (t, base_lr) read in memory instead of args->t and
                             args->base_lr, so that a CUDA graph's replays see the step's own
                             (not checked: they are on the device); optional */
} tm_cms_inputs;

/* Scratch of tm_cms_step: partial sums per (CPU block of 4,096 elements or CUDA slice of 8,192,
 * level) and per-(tensor, level) results; depends on the params' numels, the backend, levels
 * and net only, so a caller may keep one buffer for every step. */
size_t tm_cms_scratch_bytes(const tm_tensor_list *params, int32_t levels, tm_cms_net net);

/* Phase 2 of the CMS step (spec 7.2) for every tensor, as the reference's _cms_update_param:
 * every level accumulates the scaled gradient; each firing level l takes g^ = (A_l + g) / div_l,
 * resets A_l, counts the firing, updates e_l and v_sq_l, runs its momentum network, clamps
 * m_l; the finite contributions are summed, divided by sqrt(n) (n > 1), weight decay added, and
 * p -= lr[group] * u (skipped when n == 0). Deterministic: reductions use fixed partials in
 * double, combined in index order. One known gap: a tensor whose finite contributions have L2
 * norms summing to >= FLT_MAX / 2 is skipped (the reference skips only if u actually overflows).
 * No host synchronization on CUDA. */
tm_status tm_cms_step(const tm_cms_tensors *t, const tm_cms_args *args, const tm_cms_inputs *in,
                      const tm_exec *exec);

/* Every check of tm_cms_step with the same arguments, and nothing run: a caller that writes
 * other state first (the DeepNestedOptimizer's Phase 1 trains the momentum network before
 * Phase 2) learns before that write whether the step would be refused. */
tm_status tm_cms_check(const tm_cms_tensors *t, const tm_cms_args *args, const tm_cms_inputs *in,
                       const tm_exec *exec);

/* ---------------------------------------------------------------- CMS surrogate ---- */

/* Phase 1 of the CMS step (spec 7.2, loss 7.4): the DirectUpdateMLP's surrogate training
 * gradient over the (at most 20) chosen tensors. Per tensor i, with g = targets[i] * scale /
 * divisor (in float32, the reference's ops; a non-finite g counts as 0, so a NaN or Inf gradient
 * element, or a step skipped by passing scale 0, cannot turn the MLP's weights NaN for good) and
 * o = MLP(g, momentum[i]) element-wise:
 *   loss_i = R + 0.1 M (+ 0.1 mean((o - prev)^2) when has_prev[i]),
 * R = 1 - cos(o, g) and M = (||o|| / ||g|| - 1)^2 when ||g||, ||o|| > 1e-8 (M = ||o||^2 when
 * ||g|| is not), prev = outputs[i] on entry. The op writes losses[i], o into outputs[i] (the next
 * call's prev), and weight_grads[k] = d mean_i(loss_i) / d weights[k]. The caller clips those
 * and takes the Adam step. Every reduction is in double over fixed blocks, combined in order
 * (the weights' gradient summed in float lanes within a block): deterministic and independent of
 * the thread count and the backend; not the bits of torch's autograd (whose sums run in another
 * order), about 1e-6 relative from them. */
typedef struct {
    tm_tensor_list targets;      /* g's source per tensor: A_0 (float32) or the gradient (any) */
    tm_tensor_list momentum;     /* m_0 per tensor: float32, the target's numel (and shape) */
    tm_tensor_list outputs;      /* float32, the target's numel (and shape): prev in (has_prev),
                                    o out */
    tm_tensor_list weights;      /* as tm_cms_tensors.weights for TM_CMS_DIRECT */
    tm_tensor_list weight_grads; /* float32, one per weight with its numel (and shape); written */
} tm_cms_surrogate_tensors;

typedef struct {
    double divisor;          /* max(cms_frequencies[0], 1): finite and >= 1 */
    int32_t hidden;          /* H in [1, 20] */
    int32_t layers;          /* L in [1, 8] */
    const int32_t *has_prev; /* host [targets.count]; nonzero: outputs[i] holds the last o.
                                NULL: none does */
} tm_cms_surrogate_args;

typedef struct {
    tm_tensor scale;  /* float32 [1]: the clip coefficient; optional (= 1, not applied) */
    tm_tensor losses; /* float32 [targets.count]; written */
} tm_cms_surrogate_inputs;

/* Scratch of tm_cms_surrogate: per-block partial sums and gradients (doubles), per-tensor loss
 * coefficients; depends on the targets' numels, L and the backend only, so a caller may keep one
 * buffer for every call with the same sizes. The op writes every part it reads (no zeroing). */
size_t tm_cms_surrogate_scratch_bytes(const tm_tensor_list *targets, int32_t layers);

/* On the CPU and on CUDA, with the same bits (the blocks, lanes and order of every sum are
 * common/tm_cms_surrogate.h's). On CUDA: no host synchronization, nothing allocated, every launch
 * on exec->stream (capturable in a CUDA graph), no atomics: the same bits on every run. */
tm_status tm_cms_surrogate(const tm_cms_surrogate_tensors *t, const tm_cms_surrogate_args *args,
                           const tm_cms_surrogate_inputs *in, const tm_exec *exec);

#ifdef __cplusplus
}
#endif

#endif /* TITANMAC_CMS_H */
