/*
 * cpu_ops.c -- the CPU drivers of the element-wise ops (AdamW, scale, clip coefficient) and the
 * block partitioning all CPU ops share (cpu_norms.c adds the reductions).
 *
 * Partitioning: every tensor is cut into blocks of TM_CPU_BLOCK elements (its last block
 * shorter), numbered across the list in order; thread t of T gets global blocks
 * [B*t/T, B*(t+1)/T), found by one walk over the list, with nothing allocated. Element-wise ops
 * give the same bits for any split; reductions keep one partial per block (cpu_norms.c).
 * OpenMP is optional: without it everything runs on the calling thread.
 *
 * AdamW follows torch.optim.AdamW per tensor: step += 1, coefficients (bias corrections) from
 * the new step in double via tm_adamw_coeffs_make, then tm_adamw_elem on every element. Steps are
 * read while the elements are updated and written after, so a thread starting in the middle of
 * a tensor sees the same step as the thread that has its first block. A nonzero skip[0] changes
 * nothing, or with zero_grads_on_skip writes 0 into every grad and nothing else. With a
 * loss_scale the loop also divides each gradient by it and stores it back (torch.amp's unscale).
 */
#include "cpu_ops.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <string.h>

#include "../common/tm_tensor.h"

int64_t
cpu_count_blocks(const tm_tensor_list *lead)
{
    int64_t blocks = 0;
    for (int32_t i = 0; i < lead->count; i++) {
        blocks += cpu_blocks_of(lead->tensors[i].numel);
    }
    return blocks;
}

/* Calls fn for the part of each tensor that falls into global blocks [begin, end). */
static void
run_range(const tm_tensor_list *lead, int64_t begin, int64_t end, cpu_segment_fn fn, void *ctx)
{
    int64_t first = 0; /* global index of tensor i's first block */
    for (int32_t i = 0; i < lead->count && first < end; i++) {
        int64_t nb = cpu_blocks_of(lead->tensors[i].numel);
        int64_t lo = begin > first ? begin : first;
        int64_t hi = end < first + nb ? end : first + nb;
        if (lo < hi) {
            fn(ctx, i, lo - first, hi - first, lo);
        }
        first += nb;
    }
}

static int
thread_count(const tm_tensor_list *lead, const tm_exec *exec, int64_t blocks)
{
    int64_t elems = 0;
    for (int32_t i = 0; i < lead->count; i++) {
        elems += lead->tensors[i].numel;
    }
    int64_t threads = exec->num_threads > 0 ? exec->num_threads : 1;
    if (elems < TM_CPU_SERIAL_ELEMS) {
        threads = 1;
    }
    return (int)(threads < blocks ? threads : (blocks > 0 ? blocks : 1));
}

void
cpu_for_each_block(const tm_tensor_list *lead, const tm_exec *exec, cpu_segment_fn fn, void *ctx)
{
    int64_t blocks = cpu_count_blocks(lead);
    int threads = thread_count(lead, exec, blocks);
#ifdef _OPENMP
    if (threads > 1) {
        /* The split uses the team size actually granted (omp_set_dynamic may grant fewer). */
#pragma omp parallel num_threads(threads)
        {
            int64_t t = omp_get_thread_num();
            int64_t nt = omp_get_num_threads();
            run_range(lead, blocks * t / nt, blocks * (t + 1) / nt, fn, ctx);
        }
        return;
    }
#endif
    (void)threads; /* without OpenMP everything runs on the calling thread */
    run_range(lead, 0, blocks, fn, ctx);
}

/* ---------------------------------------------------------------- AdamW ---- */

typedef struct {
    const tm_adamw_tensors *t;
    const tm_adamw_args *args;
    const tm_tensor *lr; /* float32 or float64 */
    double grad_scale;   /* as given: rounded to float for all but float64 tensors */
    float loss_scale;
    int32_t unscale; /* a loss_scale given */
    cpu_adamw_fn const *loops;
} adamw_ctx;

static float
next_step(const tm_tensor *step)
{
    return (float)(*(const float *)step->data + 1.0f);
}

static void
adamw_segment(void *vctx, int32_t i, int64_t b0, int64_t b1, int64_t global_block)
{
    const adamw_ctx *ctx = vctx;
    const tm_adamw_tensors *t = ctx->t;
    const tm_adamw_args *args = ctx->args;
    int32_t group = args->group_of != NULL ? args->group_of[i] : 0;
    const tm_adamw_group *hp = &args->groups[group];
    const double lr = cpu_read_real(ctx->lr, group);
    const double step = next_step(&t->step.tensors[i]);
    const tm_tensor *p = &t->params.tensors[i];
    tm_adamw_coeffs c32;
    tm_adamw_coeffs_f64 c64;
    const void *c;
    if (p->dtype == TM_FLOAT64) {
        c64 = tm_adamw_coeffs_f64_make(lr, hp->beta1, hp->beta2, hp->eps, hp->weight_decay, step,
                                       ctx->grad_scale, hp->maximize != 0, args->amsgrad != 0);
        c64.loss_scale = ctx->loss_scale;
        c = &c64;
    } else {
        c32 = tm_adamw_coeffs_make(lr, hp->beta1, hp->beta2, hp->eps, hp->weight_decay, step,
                                   (float)ctx->grad_scale, hp->maximize != 0, args->amsgrad != 0);
        c32.loss_scale = ctx->loss_scale;
        c = &c32;
    }
    int64_t offset;
    int64_t n = cpu_segment_elems(p->numel, b0, b1, &offset);
    void *vmax = args->amsgrad ? cpu_elem_ptr(&t->max_exp_avg_sq.tensors[i], offset) : NULL;
    (void)global_block;
    ctx->loops[p->dtype](cpu_elem_ptr(p, offset), cpu_elem_ptr(&t->grads.tensors[i], offset),
                         cpu_elem_ptr(&t->exp_avg.tensors[i], offset),
                         cpu_elem_ptr(&t->exp_avg_sq.tensors[i], offset), vmax, n, c,
                         ctx->unscale);
}

/* zero_grads_on_skip: the DNO's NaN guard zeroes the gradients instead of stepping. All-zero
 * bytes are +0.0 in every supported dtype. */
static void
zero_segment(void *vctx, int32_t i, int64_t b0, int64_t b1, int64_t global_block)
{
    const tm_tensor *g = &((const tm_tensor_list *)vctx)->tensors[i];
    int64_t offset;
    int64_t n = cpu_segment_elems(g->numel, b0, b1, &offset);
    (void)global_block;
    memset(cpu_elem_ptr(g, offset), 0, (size_t)n * tm_dtype_size(g->dtype));
}

tm_status
cpu_adamw_step(const tm_adamw_tensors *t, const tm_adamw_args *args, const tm_adamw_inputs *in,
               const tm_exec *exec)
{
    if (tm_tensor_given(&in->skip) && *(const float *)in->skip.data != 0.0f) {
        if (args->zero_grads_on_skip) {
            cpu_for_each_block(&t->grads, exec, zero_segment, (void *)&t->grads);
        }
        return TM_OK;
    }
    adamw_ctx ctx = {
        .t = t,
        .args = args,
        .lr = &in->lr,
        .grad_scale = tm_tensor_given(&in->grad_scale) ? cpu_read_real(&in->grad_scale, 0) : 1.0,
        .loss_scale = tm_tensor_given(&in->loss_scale) ? *(const float *)in->loss_scale.data : 1.0f,
        .unscale = tm_tensor_given(&in->loss_scale),
        .loops = cpu_active_kernels()->adamw,
    };
    cpu_for_each_block(&t->params, exec, adamw_segment, &ctx);
    /* After every element: a step is read by all threads working on its tensor. */
    for (int32_t i = 0; i < t->params.count; i++) {
        const tm_tensor *step = &t->step.tensors[i];
        *(float *)step->data = next_step(step);
    }
    return TM_OK;
}

/* ---------------------------------------------------------------- scale, clip ---- */

typedef struct {
    const tm_tensor_list *tensors;
    double scale;
    cpu_scale_fn const *loops;
} scale_ctx;

static void
scale_segment(void *vctx, int32_t i, int64_t b0, int64_t b1, int64_t global_block)
{
    const scale_ctx *ctx = vctx;
    const tm_tensor *x = &ctx->tensors->tensors[i];
    int64_t offset;
    int64_t n = cpu_segment_elems(x->numel, b0, b1, &offset);
    (void)global_block;
    ctx->loops[x->dtype](cpu_elem_ptr(x, offset), n, ctx->scale);
}

tm_status
cpu_scale(const tm_tensor_list *tensors, const tm_tensor *scale, const tm_exec *exec)
{
    /* Read once up front, as every block scales by the same value (the memory-sharing check
     * refuses a factor that lies inside a tensor being scaled). */
    scale_ctx ctx = {tensors, cpu_read_real(scale, 0), cpu_active_kernels()->scale};
    cpu_for_each_block(tensors, exec, scale_segment, &ctx);
    return TM_OK;
}

tm_status
cpu_clip_coef(const tm_tensor *total_norm, double max_norm, const tm_tensor *coef,
              const tm_exec *exec)
{
    (void)exec;
    tm_real_store_clip_coef(coef->data, coef->dtype == TM_FLOAT64, cpu_read_scalar(total_norm),
                            max_norm);
    return TM_OK;
}
