/*
 * tm_validate.c -- the argument checks of each public op (see tm_validate.h): its role table for
 * the shared tensor checks of tm_roles.c, then what only this op knows (list counts, scalar
 * tensor shapes, hyperparameter ranges as torch.optim.AdamW's constructor checks them, scratch).
 */
#include "tm_validate.h"

#include <math.h>

#include "../common/tm_status.h"
#include "tm_roles.h"

/* ---------------------------------------------------------------- norms ---- */

enum {
    NORMS_GRADS,
    NORMS_PARAMS,
    NORMS_GROUP_GRAD,
    NORMS_GROUP_PARAM,
    NORMS_TOTAL_GRAD,
    NORMS_TOTAL_PARAM,
    NORMS_NONFINITE,
    NORMS_COEF,
    NORMS_ROLES
};

static tm_status
check_group_of(const int32_t *group_of, int32_t count, int32_t num_groups)
{
    for (int32_t i = 0; group_of != NULL && i < count; i++) {
        TM_CHECK(group_of[i] >= 0 && group_of[i] < num_groups, TM_ERR_VALUE,
                 "group_of[%d] = %d is not in [0, %d)", (int)i, (int)group_of[i], (int)num_groups);
    }
    return TM_OK;
}

/* Outputs: float32 or float64 (each written in its own dtype), [num_groups] per group and [1] for
 * the totals; param outputs need params. */
static tm_status
check_norms_outputs(const tm_role *roles, int32_t num_groups, int params_ok)
{
    for (int k = NORMS_GROUP_GRAD; k < NORMS_ROLES; k++) {
        const tm_tensor *t = roles[k].list.tensors;
        const char *name = roles[k].list.name;
        int optional = k != NORMS_GROUP_GRAD && k != NORMS_TOTAL_GRAD;
        if (optional && !tm_tensor_given(t)) {
            continue;
        }
        TM_CHECK(params_ok || (k != NORMS_GROUP_PARAM && k != NORMS_TOTAL_PARAM), TM_ERR_VALUE,
                 "%s: wanted, but no params were given", name);
        int per_group = k == NORMS_GROUP_GRAD || k == NORMS_GROUP_PARAM;
        TM_TRY(tm_check_real_numel(t, name, TM_NO_INDEX, per_group ? num_groups : 1));
    }
    return TM_OK;
}

tm_status
tm_validate_norms(const tm_tensor_list *grads, const tm_tensor_list *params,
                  const tm_norms_args *args, const tm_norms_out *out, const tm_exec *exec,
                  tm_device_ref *ref)
{
    TM_CHECK(grads != NULL && args != NULL && out != NULL, TM_ERR_INTERNAL,
             "tm_norms: grads, args and out must not be NULL");
    TM_CHECK(exec != NULL, TM_ERR_INTERNAL, "exec is NULL");
    tm_role roles[NORMS_ROLES] = {
        /* each tensor's norm is its own: any order, and params need not pair with grads */
        [NORMS_GRADS] = tm_list_role(grads, "grads", TM_ROLE_ANY_ORDER),
        [NORMS_PARAMS] = tm_list_role(params, "params", TM_ROLE_MATCH | TM_ROLE_ANY_ORDER),
        [NORMS_GROUP_GRAD] = tm_lone_role(&out->group_grad, "group_grad", TM_ROLE_WRITTEN),
        [NORMS_GROUP_PARAM] = tm_lone_role(&out->group_param, "group_param", TM_ROLE_WRITTEN),
        [NORMS_TOTAL_GRAD] = tm_lone_role(&out->total_grad, "total_grad", TM_ROLE_WRITTEN),
        [NORMS_TOTAL_PARAM] = tm_lone_role(&out->total_param, "total_param", TM_ROLE_WRITTEN),
        [NORMS_NONFINITE] = tm_lone_role(&out->nonfinite, "nonfinite", TM_ROLE_WRITTEN),
        [NORMS_COEF] = tm_lone_role(&out->coef, "coef", TM_ROLE_WRITTEN),
    };
    const tm_tensor_list *g = &roles[NORMS_GRADS].list;
    const tm_tensor_list *p = &roles[NORMS_PARAMS].list;
    TM_TRY(tm_roles_structure(roles, NORMS_ROLES));
    if (p->count > 0) {
        TM_TRY(tm_check_count(p, g->count, g->name));
    }
    TM_TRY(tm_roles_check(roles, NORMS_ROLES, ref));
    TM_CHECK(args->norm_type > 0.0, TM_ERR_VALUE, "norm_type = %g: must be > 0 or inf",
             args->norm_type);
    TM_CHECK(args->num_groups >= 1, TM_ERR_VALUE, "num_groups = %d: must be >= 1",
             (int)args->num_groups);
    TM_TRY(check_group_of(args->group_of, g->count, args->num_groups));
    TM_TRY(check_norms_outputs(roles, args->num_groups, params != NULL && p->count == g->count));
    /* inf is torch's "measure, do not clip" idiom: the coefficient is then 1 (NaN on an
     * infinite norm, as torch's) */
    TM_CHECK(!tm_tensor_given(&out->coef) || args->max_norm >= 0.0, TM_ERR_VALUE,
             "max_norm = %g: must be >= 0 (inf: no clipping)", args->max_norm);
    TM_CHECK(!tm_tensor_given(&out->coef) || tm_dtype_size(args->result_dtype) != 0,
             TM_ERR_VALUE, "result_dtype = %d: not a tm_dtype", (int)args->result_dtype);
    return tm_check_scratch(exec, tm_norms_scratch_bytes(grads, params), roles, NORMS_ROLES);
}

/* ---------------------------------------------------------------- clip, scale ---- */

tm_status
tm_validate_clip(const tm_tensor *total_norm, double max_norm, const tm_tensor *coef,
                 const tm_exec *exec, tm_device_ref *ref)
{
    TM_CHECK(total_norm != NULL && coef != NULL, TM_ERR_INTERNAL,
             "tm_clip_coef: total_norm and coef must not be NULL");
    TM_CHECK(exec != NULL, TM_ERR_INTERNAL, "exec is NULL");
    tm_role roles[2] = {
        tm_lone_role(total_norm, "total_norm", 0),
        tm_lone_role(coef, "coef", TM_ROLE_WRITTEN),
    };
    TM_TRY(tm_roles_check(roles, 2, ref));
    TM_CHECK(max_norm >= 0.0, TM_ERR_VALUE, "max_norm = %g: must be >= 0 (inf: no clipping)",
             max_norm);
    /* the norm as the caller returns it, in any dtype (a float16 or bfloat16 one is the norm of
     * such gradients, which the coefficient must be computed from); the coefficient is the
     * multiplier of the gradients, float32 or float64 */
    TM_CHECK(total_norm->numel == 1, TM_ERR_VALUE,
             "total_norm: expected 1 element, got %s with %lld", tm_dtype_name(total_norm->dtype),
             (long long)total_norm->numel);
    TM_TRY(tm_check_real_numel(coef, "coef", TM_NO_INDEX, 1));
    return tm_check_scratch(exec, 0, roles, 2);
}

tm_status
tm_validate_scale(const tm_tensor_list *tensors, const tm_tensor *scale, const tm_exec *exec,
                  tm_device_ref *ref)
{
    TM_CHECK(tensors != NULL && scale != NULL, TM_ERR_INTERNAL,
             "tm_scale: tensors and scale must not be NULL");
    TM_CHECK(exec != NULL, TM_ERR_INTERNAL, "exec is NULL");
    tm_role roles[2] = {
        tm_list_role(tensors, "tensors", TM_ROLE_WRITTEN | TM_ROLE_ANY_ORDER),
        tm_lone_role(scale, "scale", 0),
    };
    TM_TRY(tm_roles_structure(roles, 2));
    TM_TRY(tm_roles_check(roles, 2, ref));
    TM_TRY(tm_check_real_numel(scale, "scale", TM_NO_INDEX, 1));
    return tm_check_scratch(exec, 0, roles, 2);
}

/* ---------------------------------------------------------------- AdamW ---- */

enum {
    ADAMW_PARAMS,
    ADAMW_GRADS,
    ADAMW_EXP_AVG,
    ADAMW_EXP_AVG_SQ,
    ADAMW_MAX_EXP_AVG_SQ,
    ADAMW_STEP,
    ADAMW_LR,
    ADAMW_GRAD_SCALE,
    ADAMW_SKIP,
    ADAMW_LOSS_SCALE,
    ADAMW_ROLES
};

static tm_status
check_adamw_counts(const tm_role *roles, const tm_adamw_args *args)
{
    const tm_tensor_list *params = &roles[ADAMW_PARAMS].list;
    const tm_tensor_list *vmax = &roles[ADAMW_MAX_EXP_AVG_SQ].list;
    for (int k = ADAMW_GRADS; k <= ADAMW_STEP; k++) {
        if (k != ADAMW_MAX_EXP_AVG_SQ) {
            TM_TRY(tm_check_count(&roles[k].list, params->count, params->name));
        }
    }
    TM_CHECK(!args->amsgrad || vmax->count == params->count, TM_ERR_VALUE,
             "%s: amsgrad needs %d tensors, got %d", vmax->name, (int)params->count,
             (int)vmax->count);
    TM_CHECK(args->amsgrad || vmax->count == 0, TM_ERR_VALUE,
             "%s: amsgrad is off, expected 0 tensors, got %d", vmax->name, (int)vmax->count);
    return TM_OK;
}

static tm_status
check_steps(const tm_tensor_list *step)
{
    for (int32_t i = 0; i < step->count; i++) {
        const tm_tensor *s = &step->tensors[i];
        TM_CHECK(s->dtype == TM_FLOAT32 && s->numel == 1, TM_ERR_VALUE,
                 "%s[%d]: expected float32 with 1 element, got %s with %lld", step->name, (int)i,
                 tm_dtype_name(s->dtype), (long long)s->numel);
    }
    return TM_OK;
}

/* The ranges torch.optim.AdamW's constructor enforces; NaN fails every comparison. */
static tm_status
check_adamw_groups(const tm_adamw_args *args)
{
    TM_CHECK(args->num_groups >= 1, TM_ERR_VALUE, "num_groups = %d: must be >= 1",
             (int)args->num_groups);
    TM_CHECK(args->groups != NULL, TM_ERR_INTERNAL, "groups: NULL for %d groups",
             (int)args->num_groups);
    for (int32_t k = 0; k < args->num_groups; k++) {
        const tm_adamw_group *g = &args->groups[k];
        TM_CHECK(g->beta1 >= 0.0 && g->beta1 < 1.0, TM_ERR_VALUE,
                 "groups[%d]: beta1 = %g is not in [0, 1)", (int)k, g->beta1);
        TM_CHECK(g->beta2 >= 0.0 && g->beta2 < 1.0, TM_ERR_VALUE,
                 "groups[%d]: beta2 = %g is not in [0, 1)", (int)k, g->beta2);
        TM_CHECK(isfinite(g->eps) && g->eps >= 0.0, TM_ERR_VALUE,
                 "groups[%d]: eps = %g must be finite and >= 0", (int)k, g->eps);
        TM_CHECK(isfinite(g->weight_decay) && g->weight_decay >= 0.0, TM_ERR_VALUE,
                 "groups[%d]: weight_decay = %g must be finite and >= 0", (int)k, g->weight_decay);
    }
    return TM_OK;
}

/* Grads the call writes (zeros with zero_grads_on_skip, unscaled values with a loss_scale) must
 * be writable (named with what would be done to them); that nothing else of the call lies in
 * their memory is tm_roles_check's (TM_ROLE_STORED). */
static tm_status
check_written_grads(const tm_tensor_list *grads, const char *done)
{
    for (int32_t i = 0; i < grads->count; i++) {
        TM_CHECK((grads->tensors[i].flags & TM_TENSOR_READ_ONLY) == 0, TM_ERR_BUFFER,
                 "%s[%d]: read-only, cannot be %s", grads->name, (int)i, done);
    }
    return TM_OK;
}

tm_status
tm_validate_adamw(const tm_adamw_tensors *t, const tm_adamw_args *args, const tm_adamw_inputs *in,
                  const tm_exec *exec, tm_device_ref *ref)
{
    TM_CHECK(t != NULL && args != NULL && in != NULL, TM_ERR_INTERNAL,
             "tm_adamw_step: tensors, args and inputs must not be NULL");
    TM_CHECK(exec != NULL, TM_ERR_INTERNAL, "exec is NULL");
    /* element-wise: gradient and state in the parameter's memory order, whatever it is */
    const unsigned state = TM_ROLE_WRITTEN | TM_ROLE_MATCH | TM_ROLE_PAIRED;
    const int unscales = tm_tensor_given(&in->loss_scale);
    const int zeroes = args->zero_grads_on_skip && tm_tensor_given(&in->skip);
    tm_role roles[ADAMW_ROLES] = {
        [ADAMW_PARAMS] = tm_list_role(&t->params, "params", TM_ROLE_WRITTEN | TM_ROLE_ANY_ORDER),
        [ADAMW_GRADS] = tm_list_role(&t->grads, "grads", TM_ROLE_MATCH | TM_ROLE_PAIRED |
                                     (unscales || zeroes ? TM_ROLE_STORED : 0)),
        [ADAMW_EXP_AVG] = tm_list_role(&t->exp_avg, "exp_avg", state),
        [ADAMW_EXP_AVG_SQ] = tm_list_role(&t->exp_avg_sq, "exp_avg_sq", state),
        [ADAMW_MAX_EXP_AVG_SQ] = tm_list_role(&t->max_exp_avg_sq, "max_exp_avg_sq", state),
        [ADAMW_STEP] = tm_list_role(&t->step, "step", TM_ROLE_WRITTEN),
        [ADAMW_LR] = tm_lone_role(&in->lr, "lr", 0),
        [ADAMW_GRAD_SCALE] = tm_lone_role(&in->grad_scale, "grad_scale", 0),
        [ADAMW_SKIP] = tm_lone_role(&in->skip, "skip", 0),
        [ADAMW_LOSS_SCALE] = tm_lone_role(&in->loss_scale, "loss_scale", 0),
    };
    TM_TRY(tm_roles_structure(roles, ADAMW_ROLES));
    TM_TRY(check_adamw_counts(roles, args));
    TM_TRY(tm_roles_check(roles, ADAMW_ROLES, ref));
    if (unscales || zeroes) {
        TM_TRY(check_written_grads(&roles[ADAMW_GRADS].list, unscales ? "written" : "zeroed"));
    }
    TM_TRY(check_steps(&roles[ADAMW_STEP].list));
    TM_TRY(check_adamw_groups(args));
    TM_TRY(check_group_of(args->group_of, t->params.count, args->num_groups));
    /* lr and grad_scale may be float64, for float64 params' sake; skip and loss_scale (torch.amp's
     * float32 scale) are float32 */
    TM_TRY(tm_check_real_numel(&in->lr, "lr", TM_NO_INDEX, args->num_groups));
    for (int k = ADAMW_GRAD_SCALE; k <= ADAMW_LOSS_SCALE; k++) {
        if (tm_tensor_given(roles[k].list.tensors)) {
            TM_TRY((k == ADAMW_GRAD_SCALE ? tm_check_real_numel : tm_check_f32_numel)(
                roles[k].list.tensors, roles[k].list.name, TM_NO_INDEX, 1));
        }
    }
    return tm_check_scratch(exec, tm_adamw_scratch_bytes(t), roles, ADAMW_ROLES);
}
