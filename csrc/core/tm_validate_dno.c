/*
 * tm_validate_dno.c -- the argument checks of tm_dno_control (see tm_validate.h): the shared
 * tensor checks of tm_roles.c over its role table, then what only this op knows -- the sizes G,
 * H and L, the numel of every tensor against them (the controller's weights in the row-major
 * [out, in] layout of torch.nn.Linear) and the host hyperparameters. That no written tensor
 * shares memory with another tensor of the call (a write through lr into mu would change what
 * the step reads) is tm_roles.c's.
 */
#include <float.h>
#include <math.h>

#include "../common/tm_status.h"
#include "tm_roles.h"
#include "tm_validate.h"

enum {
    DNO_GROUP_GRAD,
    DNO_GROUP_PARAM,
    DNO_TOTAL_GRAD,
    DNO_DEPTHS,
    DNO_LOSS,
    DNO_WEIGHTS,
    DNO_MU,
    DNO_EMA,
    DNO_LR,
    DNO_COEF,
    DNO_SKIP,
    DNO_PREVIOUS,
    DNO_ROLES
};

/* G, H and L first: the weight count and every numel depend on them. */
static tm_status
check_dno_sizes(const tm_dno_control_args *a, const tm_tensor_list *weights)
{
    TM_CHECK(a->num_groups >= 1, TM_ERR_VALUE, "num_groups = %d: must be >= 1", (int)a->num_groups);
    TM_CHECK(a->hidden >= 1 && a->hidden <= TM_DNO_MAX_HIDDEN, TM_ERR_VALUE,
             "hidden = %d: must be in [1, %d] (on CUDA one thread of one block per hidden unit)",
             (int)a->hidden, TM_DNO_MAX_HIDDEN);
    TM_CHECK(a->layers >= 1 && a->layers <= TM_DNO_MAX_LAYERS, TM_ERR_VALUE,
             "layers = %d: must be in [1, %d] (on CUDA every weight is a launch parameter)",
             (int)a->layers, TM_DNO_MAX_LAYERS);
    int32_t want = 2 * (a->layers + 1);
    TM_CHECK(weights->count == want, TM_ERR_VALUE,
             "weights: %d tensors, the controller (layers = %d) has %d", (int)weights->count,
             (int)a->layers, (int)want);
    return TM_OK;
}

static tm_status
check_dno_numels(const tm_role *roles, int32_t num_groups)
{
    for (int k = 0; k < DNO_ROLES; k++) {
        if (k == DNO_WEIGHTS || (k == DNO_PREVIOUS && !tm_tensor_given(roles[k].list.tensors))) {
            continue;
        }
        int per_group = k == DNO_GROUP_GRAD || k == DNO_GROUP_PARAM || k == DNO_DEPTHS ||
                        k == DNO_MU || k == DNO_LR;
        int64_t numel = k == DNO_PREVIOUS ? 2 * (int64_t)num_groups + 4
                                          : (per_group ? num_groups : (k == DNO_EMA ? 2 : 1));
        TM_TRY(tm_check_f32_numel(roles[k].list.tensors, roles[k].list.name, TM_NO_INDEX, numel));
    }
    return TM_OK;
}

/* W0 [H, 3], b0 [H], (W_i [H, H], b_i [H]) x (L - 1), W_out [1, H], b_out [1]. */
static tm_status
check_dno_weights(const tm_tensor_list *w, const tm_dno_control_args *a)
{
    const int64_t h = a->hidden;
    for (int32_t i = 0; i < w->count; i++) {
        const tm_tensor *t = &w->tensors[i];
        int last = i >= w->count - 2;
        int bias = i % 2 == 1;
        const char *what = bias ? (last ? "1" : "H") : (i == 0 ? "H*3" : (last ? "1*H" : "H*H"));
        int64_t want = bias ? (last ? 1 : h) : (i == 0 ? h * 3 : (last ? h : h * h));
        TM_CHECK(t->dtype == TM_FLOAT32, TM_ERR_VALUE, "%s[%d]: expected float32, got %s", w->name,
                 (int)i, tm_dtype_name(t->dtype));
        TM_CHECK(t->numel == want, TM_ERR_VALUE,
                 "%s[%d]: numel %lld does not match the controller's %s = %lld", w->name, (int)i,
                 (long long)t->numel, what, (long long)want);
    }
    return TM_OK;
}

/* NaN fails every comparison, so each check also rejects it. */
static tm_status
check_dno_hparams(const tm_dno_control_args *a)
{
    TM_CHECK(isfinite(a->mu_min) && isfinite(a->mu_max) && a->mu_min < a->mu_max, TM_ERR_VALUE,
             "mu_min = %g, mu_max = %g: must be finite with mu_min < mu_max", a->mu_min, a->mu_max);
    TM_CHECK(isfinite(a->base_lr) && a->base_lr >= 0.0, TM_ERR_VALUE,
             "base_lr = %g: must be finite and >= 0", a->base_lr);
    /* the rates base_lr * mu are stored in float32: one beyond its range would be inf */
    TM_CHECK(a->base_lr * fmax(fabs(a->mu_min), fabs(a->mu_max)) <= FLT_MAX, TM_ERR_VALUE,
             "base_lr = %g: base_lr * mu_max = %g is beyond float32's range", a->base_lr,
             a->base_lr * fmax(fabs(a->mu_min), fabs(a->mu_max)));
    TM_CHECK(!isnan(a->max_grad_norm), TM_ERR_VALUE,
             "max_grad_norm = %g: must be a number (<= 0 turns clipping off)", a->max_grad_norm);
    TM_CHECK(a->ema_beta >= 0.0 && a->ema_beta <= 1.0, TM_ERR_VALUE,
             "ema_beta = %g: must be in [0, 1]", a->ema_beta);
    return TM_OK;
}

tm_status
tm_validate_dno_control(const tm_dno_control_tensors *t, const tm_dno_control_args *args,
                        const tm_exec *exec, tm_device_ref *ref)
{
    TM_CHECK(t != NULL && args != NULL, TM_ERR_INTERNAL,
             "tm_dno_control: tensors and args must not be NULL");
    TM_CHECK(exec != NULL, TM_ERR_INTERNAL, "exec is NULL");
    tm_role roles[DNO_ROLES] = {
        [DNO_GROUP_GRAD] = tm_lone_role(&t->group_grad, "group_grad", 0),
        [DNO_GROUP_PARAM] = tm_lone_role(&t->group_param, "group_param", 0),
        [DNO_TOTAL_GRAD] = tm_lone_role(&t->total_grad, "total_grad", 0),
        [DNO_DEPTHS] = tm_lone_role(&t->depths, "depths", 0),
        [DNO_LOSS] = tm_lone_role(&t->loss, "loss", 0),
        [DNO_WEIGHTS] = tm_list_role(&t->weights, "weights", 0),
        [DNO_MU] = tm_lone_role(&t->mu, "mu", TM_ROLE_WRITTEN),
        [DNO_EMA] = tm_lone_role(&t->ema, "ema", TM_ROLE_WRITTEN),
        [DNO_LR] = tm_lone_role(&t->lr, "lr", TM_ROLE_WRITTEN),
        [DNO_COEF] = tm_lone_role(&t->coef, "coef", TM_ROLE_WRITTEN),
        [DNO_SKIP] = tm_lone_role(&t->skip, "skip", TM_ROLE_WRITTEN),
        [DNO_PREVIOUS] = tm_lone_role(&t->previous, "previous", TM_ROLE_WRITTEN),
    };
    TM_TRY(tm_roles_structure(roles, DNO_ROLES));
    TM_TRY(check_dno_sizes(args, &roles[DNO_WEIGHTS].list));
    TM_TRY(tm_roles_check(roles, DNO_ROLES, ref));
    TM_TRY(check_dno_numels(roles, args->num_groups));
    TM_TRY(check_dno_weights(&roles[DNO_WEIGHTS].list, args));
    TM_TRY(check_dno_hparams(args));
    return tm_check_scratch(exec, 0, roles, DNO_ROLES);
}
