/*
 * tm_validate_cms.c -- the argument checks of tm_cms_step (see tm_validate.h): the sizes (K, the
 * network's H and L, the weight count) first, list counts, then the shared tensor checks of
 * tm_roles.c over a role table of params, grads, the 4K per-level state lists, step_counts,
 * weights and the lone inputs; then what only this op knows: float32 state, step_counts of K
 * elements, every weight's numel against (net, H, L) in torch.nn.Linear's [out, in] layout, the
 * host hyperparameters, lr/grad_scale/skip/loss/context shapes, group_of, scratch.
 *
 * Per-level lists are named "momentum[l]", "accumulated[l]", "ema[l]", "v_sq[l]" (by the binding;
 * the ema and v_sq lists may be empty: not kept, see titanmac.h;
 * these names are the defaults), so a message reads "momentum[1][3]: numel 10 does not match
 * params[3] numel 12" for level 1 of tensor 3. No written tensor may share memory with another
 * tensor of the call (tm_roles.c: lists, indices, lone inputs and weights alike).
 */
#include <math.h>

#include "../common/tm_cms_math.h"
#include "../common/tm_status.h"
#include "tm_roles.h"
#include "tm_validate.h"

enum { CMS_PARAMS, CMS_GRADS, CMS_STATE }; /* then 4 K state lists, then the rest below */
enum { CMS_STEPS, CMS_WEIGHTS, CMS_LR, CMS_GRAD_SCALE, CMS_SKIP, CMS_LOSS, CMS_CONTEXT, CMS_TAIL };
#define CMS_MAX_ROLES (CMS_STATE + 4 * TM_CMS_MAX_LEVELS + CMS_TAIL)

static const char *const cms_state_names[4][TM_CMS_MAX_LEVELS] = {
    {"momentum[0]", "momentum[1]", "momentum[2]", "momentum[3]"},
    {"accumulated[0]", "accumulated[1]", "accumulated[2]", "accumulated[3]"},
    {"ema[0]", "ema[1]", "ema[2]", "ema[3]"},
    {"v_sq[0]", "v_sq[1]", "v_sq[2]", "v_sq[3]"},
};

/* The state list of role r (0 momentum, 1 accumulated, 2 ema, 3 v_sq) at level l. */
static const tm_tensor_list *
state_list(const tm_cms_tensors *t, int r, int l)
{
    const tm_tensor_list *lists[4] = {t->momentum, t->accumulated, t->ema, t->v_sq};
    return &lists[r][l];
}

static int32_t
expected_weights(const tm_cms_args *a)
{
    return 2 * (a->layers + 1) + (a->net == TM_CMS_LEGACY ? 1 : 0);
}

/* K was checked before the role table was built; then the network's sizes. */
static tm_status
check_cms_sizes(const tm_cms_args *a, const tm_tensor_list *weights)
{
    TM_CHECK(a->net == TM_CMS_DIRECT || a->net == TM_CMS_LEGACY, TM_ERR_VALUE,
             "net = %d: must be TM_CMS_DIRECT or TM_CMS_LEGACY", (int)a->net);
    const int legacy = a->net == TM_CMS_LEGACY;
    const int max_h = legacy ? TM_CMS_LEGACY_MAX_HIDDEN : TM_CMS_DIRECT_MAX_HIDDEN;
    TM_CHECK(a->hidden >= 1 && a->hidden <= max_h, TM_ERR_VALUE,
             "hidden = %d: must be in [1, %d] for the %s network", (int)a->hidden, max_h,
             legacy ? "legacy" : "direct");
    TM_CHECK(a->layers >= 1 && a->layers <= TM_CMS_MAX_LAYERS, TM_ERR_VALUE,
             "layers = %d: must be in [1, %d]", (int)a->layers, TM_CMS_MAX_LAYERS);
    TM_CHECK(weights->count == expected_weights(a), TM_ERR_VALUE,
             "weights: %d tensors, the %s network (layers = %d) has %d", (int)weights->count,
             legacy ? "legacy" : "direct", (int)a->layers, (int)expected_weights(a));
    return TM_OK;
}

/* Role table: params, grads, the state lists of levels < K, then the tail roles. */
static int
build_roles(const tm_cms_tensors *t, const tm_cms_inputs *in, int32_t k, tm_role *roles)
{
    /* element-wise: gradient and state in the parameter's memory order, whatever it is */
    const unsigned state = TM_ROLE_WRITTEN | TM_ROLE_MATCH_NUMEL | TM_ROLE_PAIRED;
    int n = 0;
    roles[n++] = tm_list_role(&t->params, "params", TM_ROLE_WRITTEN | TM_ROLE_ANY_ORDER);
    roles[n++] = tm_list_role(&t->grads, "grads", TM_ROLE_MATCH | TM_ROLE_PAIRED);
    for (int r = 0; r < 4; r++) {
        for (int32_t l = 0; l < k; l++) {
            roles[n++] = tm_list_role(state_list(t, r, l), cms_state_names[r][l], state);
        }
    }
    roles[n++] = tm_list_role(&t->step_counts, "step_counts", TM_ROLE_WRITTEN);
    roles[n++] = tm_list_role(&t->weights, "weights", 0);
    roles[n++] = tm_lone_role(&in->lr, "lr", 0);
    roles[n++] = tm_lone_role(&in->grad_scale, "grad_scale", 0);
    roles[n++] = tm_lone_role(&in->skip, "skip", 0);
    roles[n++] = tm_lone_role(&in->loss, "loss", 0);
    roles[n++] = tm_lone_role(&in->context, "context", 0);
    return n;
}

/* Counts of every list against params (weights were checked with the sizes); the ema and v_sq
 * lists (roles 2 and 3 of the state) may also be empty: not kept. */
static tm_status
check_cms_counts(const tm_role *roles, int n, int32_t levels)
{
    const tm_tensor_list *params = &roles[CMS_PARAMS].list;
    const int optional_first = CMS_STATE + 2 * levels;
    const int optional_end = CMS_STATE + 4 * levels;
    for (int k = CMS_GRADS; k <= n - CMS_TAIL + CMS_STEPS; k++) {
        if (k >= optional_first && k < optional_end && roles[k].list.count == 0) {
            continue;
        }
        TM_TRY(tm_check_count(&roles[k].list, params->count, params->name));
    }
    return TM_OK;
}

static tm_status
check_cms_state(const tm_role *roles, int32_t k)
{
    for (int r = CMS_STATE; r < CMS_STATE + 4 * k; r++) {
        const tm_tensor_list *l = &roles[r].list;
        for (int32_t i = 0; i < l->count; i++) {
            TM_CHECK(l->tensors[i].dtype == TM_FLOAT32, TM_ERR_VALUE,
                     "%s[%d]: dtype %s, CMS state must be float32", l->name, (int)i,
                     tm_dtype_name(l->tensors[i].dtype));
        }
    }
    const tm_tensor_list *steps = &roles[CMS_STATE + 4 * k + CMS_STEPS].list;
    for (int32_t i = 0; i < steps->count; i++) {
        TM_TRY(tm_check_f32_numel(&steps->tensors[i], steps->name, i, k));
    }
    return TM_OK;
}

/* Numel of weight i of the network (module order, see titanmac.h); *what names the shape. */
static int64_t
weight_numel(const tm_cms_args *a, int32_t i, const char **what)
{
    const int64_t h = a->hidden;
    const int legacy = a->net == TM_CMS_LEGACY;
    const int64_t in = legacy ? TM_CMS_LEGACY_IN : TM_CMS_DIRECT_IN;
    const int64_t out = legacy ? TM_CMS_LEGACY_OUT : 1;
    if (legacy && i == 0) {
        *what = "residual_weight";
        return 1;
    }
    const int32_t j = i - legacy;             /* index among the Linear tensors */
    const int last = j >= 2 * a->layers;      /* the output layer */
    if (j % 2 == 1) {
        *what = last ? (legacy ? "3" : "1") : "H";
        return last ? out : h;
    }
    *what = j == 0 ? (legacy ? "H*9" : "H*4") : (last ? (legacy ? "3*H" : "1*H") : "H*H");
    return j == 0 ? h * in : (last ? out * h : h * h);
}

static tm_status
check_cms_weights(const tm_tensor_list *w, const tm_cms_args *a)
{
    for (int32_t i = 0; i < w->count; i++) {
        const tm_tensor *t = &w->tensors[i];
        const char *what = "";
        const int64_t want = weight_numel(a, i, &what);
        TM_CHECK(t->dtype == TM_FLOAT32, TM_ERR_VALUE, "%s[%d]: expected float32, got %s",
                 w->name, (int)i, tm_dtype_name(t->dtype));
        TM_CHECK(t->numel == want, TM_ERR_VALUE,
                 "%s[%d]: numel %lld does not match the %s network's %s = %lld", w->name, (int)i,
                 (long long)t->numel, a->net == TM_CMS_LEGACY ? "legacy" : "direct", what,
                 (long long)want);
    }
    return TM_OK;
}

/* NaN fails every comparison, so each check also rejects it. */
static tm_status
check_cms_hparams(const tm_cms_args *a)
{
    for (int32_t l = 0; l < a->levels; l++) {
        TM_CHECK(isfinite(a->divisors[l]) && a->divisors[l] >= 1.0, TM_ERR_VALUE,
                 "divisors[%d] = %g: must be finite and >= 1", (int)l, a->divisors[l]);
        TM_CHECK(a->ema_decays[l] >= 0.0 && a->ema_decays[l] <= 1.0, TM_ERR_VALUE,
                 "ema_decays[%d] = %g: must be in [0, 1]", (int)l, a->ema_decays[l]);
    }
    TM_CHECK(a->beta2 >= 0.0 && a->beta2 <= 1.0, TM_ERR_VALUE, "beta2 = %g: must be in [0, 1]",
             a->beta2);
    TM_CHECK(a->momentum_coef >= 0.0 && a->momentum_coef <= 1.0, TM_ERR_VALUE,
             "momentum_coef = %g: must be in [0, 1]", a->momentum_coef);
    TM_CHECK(isfinite(a->clamp_ratio) && a->clamp_ratio > 0.0, TM_ERR_VALUE,
             "clamp_ratio = %g: must be finite and > 0", a->clamp_ratio);
    TM_CHECK(isfinite(a->weight_decay) && a->weight_decay >= 0.0, TM_ERR_VALUE,
             "weight_decay = %g: must be finite and >= 0", a->weight_decay);
    TM_CHECK(isfinite(a->t) && a->t >= 0.0, TM_ERR_VALUE, "t = %g: must be finite and >= 0",
             a->t);
    TM_CHECK(isfinite(a->base_lr), TM_ERR_VALUE, "base_lr = %g: must be finite", a->base_lr);
    TM_CHECK(a->num_groups >= 1, TM_ERR_VALUE, "num_groups = %d: must be >= 1",
             (int)a->num_groups);
    return TM_OK;
}

static tm_status
check_cms_inputs(const tm_cms_inputs *in, const tm_cms_args *a, int32_t count)
{
    for (int32_t i = 0; a->group_of != NULL && i < count; i++) {
        TM_CHECK(a->group_of[i] >= 0 && a->group_of[i] < a->num_groups, TM_ERR_VALUE,
                 "group_of[%d] = %d is not in [0, %d)", (int)i, (int)a->group_of[i],
                 (int)a->num_groups);
    }
    TM_TRY(tm_check_f32_numel(&in->lr, "lr", TM_NO_INDEX, a->num_groups));
    if (tm_tensor_given(&in->grad_scale)) {
        TM_TRY(tm_check_f32_numel(&in->grad_scale, "grad_scale", TM_NO_INDEX, 1));
    }
    if (tm_tensor_given(&in->skip)) {
        TM_TRY(tm_check_f32_numel(&in->skip, "skip", TM_NO_INDEX, 1));
    }
    TM_CHECK(a->net != TM_CMS_LEGACY || tm_tensor_given(&in->loss), TM_ERR_VALUE,
             "loss: required by the legacy network (its context)");
    if (tm_tensor_given(&in->loss)) {
        TM_TRY(tm_check_f32_numel(&in->loss, "loss", TM_NO_INDEX, 1));
    }
    if (tm_tensor_given(&in->context)) {
        TM_CHECK(in->context.dtype == TM_FLOAT64 && in->context.numel == 2, TM_ERR_VALUE,
                 "context: expected float64 with 2 elements (t, base_lr), got %s with %lld",
                 tm_dtype_name(in->context.dtype), (long long)in->context.numel);
    }
    return TM_OK;
}

tm_status
tm_validate_cms(const tm_cms_tensors *t, const tm_cms_args *args, const tm_cms_inputs *in,
                const tm_exec *exec, tm_device_ref *ref)
{
    TM_CHECK(t != NULL && args != NULL && in != NULL, TM_ERR_INTERNAL,
             "tm_cms_step: tensors, args and inputs must not be NULL");
    TM_CHECK(exec != NULL, TM_ERR_INTERNAL, "exec is NULL");
    TM_CHECK(args->levels >= 1 && args->levels <= TM_CMS_MAX_LEVELS, TM_ERR_VALUE,
             "levels = %d: must be in [1, %d]", (int)args->levels, TM_CMS_MAX_LEVELS);
    tm_role roles[CMS_MAX_ROLES];
    const int n = build_roles(t, in, args->levels, roles);
    TM_TRY(tm_roles_structure(roles, n));
    TM_TRY(check_cms_sizes(args, &roles[n - CMS_TAIL + CMS_WEIGHTS].list));
    TM_TRY(check_cms_counts(roles, n, args->levels));
    TM_TRY(tm_roles_check(roles, n, ref));
    TM_TRY(check_cms_state(roles, args->levels));
    TM_TRY(check_cms_weights(&roles[n - CMS_TAIL + CMS_WEIGHTS].list, args));
    TM_TRY(check_cms_hparams(args));
    TM_TRY(check_cms_inputs(in, args, t->params.count));
    return tm_check_scratch(exec, tm_cms_scratch_bytes(&t->params, args->levels, args->net), roles,
                            n);
}

/* ---------------------------------------------------------------- tm_cms_surrogate ---- */

enum { SUR_TARGETS, SUR_MOMENTUM, SUR_OUTPUTS, SUR_WEIGHTS, SUR_WEIGHT_GRADS, SUR_SCALE,
       SUR_LOSSES, SUR_ROLES };

/* float32 for every tensor of a list (the MLP's state and outputs). */
static tm_status
check_f32_list(const tm_tensor_list *l)
{
    for (int32_t i = 0; i < l->count; i++) {
        TM_CHECK(l->tensors[i].dtype == TM_FLOAT32, TM_ERR_VALUE, "%s[%d]: dtype %s, must be "
                 "float32", l->name, (int)i, tm_dtype_name(l->tensors[i].dtype));
    }
    return TM_OK;
}

/* The sizes, counts, the shared tensor checks (targets lead: momentum and outputs match their
 * numels; weights and weight_grads pair up by index), then dtypes, shapes, divisor, scratch. */
tm_status
tm_validate_cms_surrogate(const tm_cms_surrogate_tensors *t, const tm_cms_surrogate_args *args,
                          const tm_cms_surrogate_inputs *in, const tm_exec *exec,
                          tm_device_ref *ref)
{
    TM_CHECK(t != NULL && args != NULL && in != NULL, TM_ERR_INTERNAL,
             "tm_cms_surrogate: tensors, args and inputs must not be NULL");
    TM_CHECK(exec != NULL, TM_ERR_INTERNAL, "exec is NULL");
    tm_role roles[SUR_ROLES];
    /* element-wise: momentum and outputs in the targets' memory order, whatever it is */
    roles[SUR_TARGETS] = tm_list_role(&t->targets, "targets", TM_ROLE_ANY_ORDER);
    roles[SUR_MOMENTUM] = tm_list_role(&t->momentum, "momentum",
                                       TM_ROLE_MATCH_NUMEL | TM_ROLE_PAIRED);
    roles[SUR_OUTPUTS] = tm_list_role(&t->outputs, "outputs",
                                      TM_ROLE_WRITTEN | TM_ROLE_MATCH_NUMEL | TM_ROLE_PAIRED);
    roles[SUR_WEIGHTS] = tm_list_role(&t->weights, "weights", 0);
    roles[SUR_WEIGHT_GRADS] = tm_list_role(&t->weight_grads, "weight_grads", TM_ROLE_WRITTEN);
    roles[SUR_SCALE] = tm_lone_role(&in->scale, "scale", 0);
    roles[SUR_LOSSES] = tm_lone_role(&in->losses, "losses", TM_ROLE_WRITTEN);
    TM_TRY(tm_roles_structure(roles, SUR_ROLES));
    const tm_cms_args net = {.net = TM_CMS_DIRECT, .hidden = args->hidden,
                             .layers = args->layers};
    const tm_tensor_list *w = &roles[SUR_WEIGHTS].list;
    const tm_tensor_list *wg = &roles[SUR_WEIGHT_GRADS].list;
    TM_TRY(check_cms_sizes(&net, w));
    TM_TRY(tm_check_count(&roles[SUR_MOMENTUM].list, t->targets.count, "targets"));
    TM_TRY(tm_check_count(&roles[SUR_OUTPUTS].list, t->targets.count, "targets"));
    TM_TRY(tm_check_count(wg, w->count, w->name));
    TM_TRY(tm_roles_check(roles, SUR_ROLES, ref));
    TM_TRY(check_f32_list(&roles[SUR_MOMENTUM].list));
    TM_TRY(check_f32_list(&roles[SUR_OUTPUTS].list));
    TM_TRY(check_cms_weights(w, &net));
    TM_TRY(check_f32_list(wg));
    for (int32_t i = 0; i < wg->count; i++) {
        const tm_tensor *a = &wg->tensors[i], *b = &w->tensors[i];
        char sa[TM_SHAPE_TEXT], sb[TM_SHAPE_TEXT];
        TM_CHECK(a->numel == b->numel, TM_ERR_VALUE,
                 "%s[%d]: numel %lld does not match %s[%d] numel %lld", wg->name, (int)i,
                 (long long)a->numel, w->name, (int)i, (long long)b->numel);
        /* element k of a weight's gradient is written for element k of the weight: a gradient
         * of the transposed shape would hold every element in another's place */
        TM_CHECK(tm_same_shape(a, b), TM_ERR_VALUE, "%s[%d]: shape %s does not match %s[%d] "
                 "shape %s", wg->name, (int)i, tm_shape_text(a, sa), w->name, (int)i,
                 tm_shape_text(b, sb));
    }
    TM_CHECK(isfinite(args->divisor) && args->divisor >= 1.0, TM_ERR_VALUE,
             "divisor = %g: must be finite and >= 1", args->divisor);
    if (tm_tensor_given(&in->scale)) {
        TM_TRY(tm_check_f32_numel(&in->scale, "scale", TM_NO_INDEX, 1));
    }
    TM_CHECK(tm_tensor_given(&in->losses), TM_ERR_VALUE, "losses: required (one per target)");
    TM_TRY(tm_check_f32_numel(&in->losses, "losses", TM_NO_INDEX, t->targets.count));
    return tm_check_scratch(exec, tm_cms_surrogate_scratch_bytes(&t->targets, args->layers),
                            roles, SUR_ROLES);
}
