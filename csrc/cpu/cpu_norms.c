/*
 * cpu_norms.c -- per-group and total p-norms of gradients (and parameters) on the CPU, plus the
 * non-finite flag: the deterministic two-pass reduction of llm.c's global_norm and apex's
 * multi_tensor_l2norm (partials per block, then one ordered combine), on CPU threads.
 *
 * Pass 1 (parallel over blocks): each block's reduced value (sum |x|^p in double, or max |x|)
 * goes to its own slot of the caller's scratch. Pass 2 (one thread): the slots are combined in
 * block order into each group and into the total, and tm_norm_finish turns sums into norms. A
 * block's value and the order of the combine are fixed, so the bits depend on neither the thread
 * count nor the instruction set.
 *
 * Non-finite flag: for p = 1, 2 and inf the reduced total is non-finite exactly when some
 * element is (a float squared cannot overflow a double sum); for other p, |x|^p may overflow, so
 * pass 1 also records per block whether an element is NaN or inf.
 *
 * Scratch: double[blocks] for grads, double[blocks] for the flags, and double[blocks] for params
 * when params are given.
 */
#include <math.h>

#include "../common/tm_tensor.h"
#include "cpu_ops.h"

/* Groups combined per walk over the blocks: the accumulators live on the stack, and most calls
 * have fewer groups than this, so the walk happens once. */
#define CPU_GROUP_CHUNK 64

typedef struct {
    const tm_tensor_list *grads;
    const tm_tensor_list *params; /* NULL when no param norm is wanted */
    cpu_norm_kind kind;
    double p;
    double *grad_part;
    double *flag_part; /* NULL unless kind == CPU_NORM_LP */
    double *param_part;
    const cpu_kernels *k;
} norms_ctx;

static int
params_given(const tm_tensor_list *params)
{
    return params != NULL && params->count > 0;
}

size_t
cpu_norms_scratch_bytes(const tm_tensor_list *grads, const tm_tensor_list *params)
{
    if (grads == NULL) {
        return 0;
    }
    size_t lists = params_given(params) ? 3 : 2;
    return (size_t)cpu_count_blocks(grads) * lists * sizeof(double);
}

static cpu_norm_kind
norm_kind(double p)
{
    if (p == 1.0) {
        return CPU_NORM_L1;
    }
    if (p == 2.0) {
        return CPU_NORM_L2;
    }
    return isinf(p) ? CPU_NORM_LINF : CPU_NORM_LP;
}

static void
norms_segment(void *vctx, int32_t i, int64_t b0, int64_t b1, int64_t global_block)
{
    const norms_ctx *ctx = vctx;
    const tm_tensor *g = &ctx->grads->tensors[i];
    for (int64_t b = b0, slot = global_block; b < b1; b++, slot++) {
        int64_t offset;
        int64_t n = cpu_segment_elems(g->numel, b, b + 1, &offset);
        const void *gx = cpu_elem_ptr(g, offset);
        ctx->grad_part[slot] = ctx->k->reduce[g->dtype](gx, n, ctx->kind, ctx->p);
        if (ctx->flag_part != NULL) {
            ctx->flag_part[slot] = ctx->k->nonfinite[g->dtype](gx, n);
        }
        if (ctx->params != NULL) {
            const tm_tensor *x = &ctx->params->tensors[i];
            ctx->param_part[slot] =
                ctx->k->reduce[x->dtype](cpu_elem_ptr(x, offset), n, ctx->kind, ctx->p);
        }
    }
}

static double
join(double acc, double part, cpu_norm_kind kind)
{
    return kind == CPU_NORM_LINF ? cpu_max_nan(acc, part) : acc + part;
}

/* out[g] = norm of the blocks of group g, for every group; blocks taken in index order. */
static void
combine_groups(const norms_ctx *ctx, const double *part, const tm_norms_args *args,
               const tm_tensor *out)
{
    double acc[CPU_GROUP_CHUNK];
    /* int64: g0 += 64 would pass INT32_MAX (and wrap) when num_groups is within 64 of it */
    for (int64_t g0 = 0; g0 < args->num_groups; g0 += CPU_GROUP_CHUNK) {
        int32_t ng = (int32_t)(args->num_groups - g0 < CPU_GROUP_CHUNK ? args->num_groups - g0
                                                                          : CPU_GROUP_CHUNK);
        for (int32_t j = 0; j < ng; j++) {
            acc[j] = 0.0;
        }
        int64_t first = 0;
        for (int32_t i = 0; i < ctx->grads->count; i++) {
            int64_t nb = cpu_blocks_of(ctx->grads->tensors[i].numel);
            int32_t j = (int32_t)((args->group_of != NULL ? args->group_of[i] : 0) - g0);
            for (int64_t b = 0; j >= 0 && j < ng && b < nb; b++) {
                acc[j] = join(acc[j], part[first + b], ctx->kind);
            }
            first += nb;
        }
        for (int32_t j = 0; j < ng; j++) {
            cpu_store_real(out, g0 + j, tm_norm_finish(acc[j], ctx->p));
        }
    }
}

static double
combine_all(const double *part, int64_t blocks, cpu_norm_kind kind)
{
    double acc = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        acc = join(acc, part[b], kind);
    }
    return acc;
}

/* Pass 2 and the stores; runs on the calling thread after pass 1 has finished. */
static void
write_outputs(const norms_ctx *ctx, const tm_norms_args *args, const tm_norms_out *out,
              int64_t blocks)
{
    double total = combine_all(ctx->grad_part, blocks, ctx->kind);
    combine_groups(ctx, ctx->grad_part, args, &out->group_grad);
    cpu_store_real(&out->total_grad, 0, tm_norm_finish(total, ctx->p));
    if (tm_tensor_given(&out->coef)) {
        /* from the norm as stored and rounded to the dtype the caller returns it in, as
         * tm_clip_coef computes it from that returned norm */
        tm_real_store_clip_coef(out->coef.data, out->coef.dtype == TM_FLOAT64,
                                cpu_round_to(cpu_read_real(&out->total_grad, 0),
                                             args->result_dtype),
                                args->max_norm);
    }
    if (tm_tensor_given(&out->nonfinite)) {
        int bad = ctx->flag_part != NULL ? combine_all(ctx->flag_part, blocks, CPU_NORM_L1) != 0.0
                                         : !isfinite(total);
        cpu_store_real(&out->nonfinite, 0, bad ? 1.0 : 0.0);
    }
    if (ctx->params == NULL) {
        return;
    }
    if (tm_tensor_given(&out->group_param)) {
        combine_groups(ctx, ctx->param_part, args, &out->group_param);
    }
    if (tm_tensor_given(&out->total_param)) {
        cpu_store_real(&out->total_param, 0,
                       tm_norm_finish(combine_all(ctx->param_part, blocks, ctx->kind), ctx->p));
    }
}

tm_status
cpu_norms(const tm_tensor_list *grads, const tm_tensor_list *params, const tm_norms_args *args,
          const tm_norms_out *out, const tm_exec *exec)
{
    int64_t blocks = cpu_count_blocks(grads);
    double *scratch = exec->scratch;
    /* Validation allows param outputs only with a params list of the grads' count. */
    int want_params = params != NULL &&
                      (tm_tensor_given(&out->group_param) || tm_tensor_given(&out->total_param));
    norms_ctx ctx = {
        .grads = grads,
        .params = want_params ? params : NULL,
        .kind = norm_kind(args->norm_type),
        .p = args->norm_type,
        .grad_part = scratch,
        .flag_part = NULL,
        .param_part = NULL,
        .k = cpu_active_kernels(),
    };
    if (blocks > 0) { /* scratch may be NULL when there is nothing to reduce */
        ctx.flag_part = ctx.kind == CPU_NORM_LP ? scratch + blocks : NULL;
        ctx.param_part = want_params ? scratch + 2 * blocks : NULL;
    }
    cpu_for_each_block(grads, exec, norms_segment, &ctx);
    write_outputs(&ctx, args, out, blocks);
    return TM_OK;
}
