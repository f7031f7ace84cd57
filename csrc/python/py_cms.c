/*
 * py_cms.c -- the bindings of tm_cms_step and tm_cms_scratch_bytes (the DeepNestedOptimizer's CMS
 * update): parse, import every tensor list (the state as one list per level, named
 * "momentum[l]" etc. so messages read "momentum[1][3]: ..."), one call with the GIL released on
 * the CPU, map the status (py_call.c). The core validates every tensor and number; here only
 * Python types, the level count shared by all per-level arguments, and the network's name.
 *
 *   cms_step(params, grads, momentum, accumulated, ema, v_sq, step_counts, lr, group_of, weights,
 *            *, fires, divisors, ema_decays, net, hidden, layers, weight_decay, t, base_lr, loss,
 *            grad_scale=None, skip=None, context=None, beta2=0.999, momentum_coef=0.9,
 *            clamp_ratio=100.0, num_threads=1, stream=None, scratch=None, check_only=False)
 *   cms_scratch_bytes(params, *, levels, net)
 *
 * momentum, accumulated, ema and v_sq are sequences of K lists (level l: one tensor per param);
 * fires, divisors and ema_decays sequences of K numbers; K = len(momentum) in [1, 4]. net is
 * "direct" or "legacy"; weights = list(network.parameters()) (see titanmac.h). The number of
 * groups is lr's numel.
 */
#include "py_call.h"

static const char *const role_names[4] = {"momentum", "accumulated", "ema", "v_sq"};
static const char *const level_names[4][TM_CMS_MAX_LEVELS] = {
    {"momentum[0]", "momentum[1]", "momentum[2]", "momentum[3]"},
    {"accumulated[0]", "accumulated[1]", "accumulated[2]", "accumulated[3]"},
    {"ema[0]", "ema[1]", "ema[2]", "ema[3]"},
    {"v_sq[0]", "v_sq[1]", "v_sq[2]", "v_sq[3]"},
};

/* A sequence's length as the level count: the first per-level argument (momentum) sets *k,
 * every other one must have the same length. */
static int
level_count(PyObject *seq, const char *name, const char *what, Py_ssize_t *k)
{
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a list of %s per level, got %.100s", name,
                     what, PY_TYPE_NAME(seq));
        return -1;
    }
    const Py_ssize_t n = py_seq_size(seq);
    if (*k < 0 && (n < 1 || n > TM_CMS_MAX_LEVELS)) {
        PyErr_Format(PyExc_ValueError, "%s: %zd levels, must be in [1, %d]", name, n,
                     TM_CMS_MAX_LEVELS);
        return -1;
    }
    if (*k >= 0 && n != *k) {
        PyErr_Format(PyExc_ValueError, "%s: %zd levels, momentum has %zd", name, n, *k);
        return -1;
    }
    *k = n;
    return 0;
}

/* role r's per-level lists -> out[0..K-1]. */
static int
import_levels(py_batch *b, PyObject *seq, int r, Py_ssize_t *k, tm_tensor_list *out)
{
    if (level_count(seq, role_names[r], "lists of tensors", k) < 0) {
        return -1;
    }
    for (Py_ssize_t l = 0; l < *k; l++) {
        if (l >= py_seq_size(seq)) { /* __dlpack__ may run any Python code */
            PyErr_Format(PyExc_RuntimeError, "%s: the list changed size during the call",
                         role_names[r]);
            return -1;
        }
        PyObject *item = Py_NewRef(py_seq_item(seq, l));
        int rc = py_import_list(b, item, level_names[r][l], 0, &out[l]);
        Py_DECREF(item);
        if (rc < 0) {
            return -1;
        }
    }
    return 0;
}

/* fires (truth values), divisors and ema_decays (floats): K numbers each. */
static int
parse_level_numbers(PyObject *const seqs[3], Py_ssize_t k, tm_cms_args *a)
{
    static const char *const names[3] = {"fires", "divisors", "ema_decays"};
    for (int s = 0; s < 3; s++) {
        PyObject *tup = NULL;
        if (level_count(seqs[s], names[s], s == 0 ? "bools" : "floats", &k) < 0 ||
            (tup = PySequence_Tuple(seqs[s])) == NULL) {
            return -1;
        }
        /* stop at the first failure: the next conversion may run Python code (__bool__,
         * __float__), which must not run with an exception set */
        for (Py_ssize_t l = 0; l < k && l < PyTuple_Size(tup) && !PyErr_Occurred(); l++) {
            PyObject *item = PyTuple_GetItem(tup, l);
            if (s == 0) {
                a->fires[l] = PyObject_IsTrue(item);
            } else {
                (s == 1 ? a->divisors : a->ema_decays)[l] = PyFloat_AsDouble(item);
            }
        }
        Py_DECREF(tup);
        if (PyErr_Occurred()) {
            return -1;
        }
    }
    return 0;
}

static int
parse_net(PyObject *obj, tm_cms_net *net)
{
    Py_ssize_t n = 0; /* compared with its length: 'direct\0x' is not 'direct' */
    const char *s = PyUnicode_Check(obj) ? PyUnicode_AsUTF8AndSize(obj, &n) : NULL;
    if (s != NULL && n == 6 && strcmp(s, "direct") == 0) {
        *net = TM_CMS_DIRECT;
        return 0;
    }
    if (s != NULL && n == 6 && strcmp(s, "legacy") == 0) {
        *net = TM_CMS_LEGACY;
        return 0;
    }
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "net: expected 'direct' or 'legacy', got %R", obj);
    return -1;
}

/* The keyword-only arguments without a default (req[0..9] in kwlist order). */
static int
cms_required(PyObject *const req[10], tm_cms_args *a)
{
    static const char *const names[10] = {"fires", "divisors", "ema_decays", "net", "hidden",
                                          "layers", "weight_decay", "t", "base_lr", "loss"};
    for (int k = 0; k < 10; k++) {
        if (req[k] == NULL) {
            PyErr_Format(PyExc_TypeError,
                         "cms_step() missing required keyword-only argument: '%s'", names[k]);
            return -1;
        }
    }
    long h = PyLong_AsLong(req[4]);
    long l = h == -1 && PyErr_Occurred() ? -1 : PyLong_AsLong(req[5]);
    if (PyErr_Occurred() || parse_net(req[3], &a->net) < 0) {
        return -1;
    }
    a->hidden = h < INT32_MIN || h > INT32_MAX ? -1 : (int32_t)h;
    a->layers = l < INT32_MIN || l > INT32_MAX ? -1 : (int32_t)l;
    a->weight_decay = PyFloat_AsDouble(req[6]);
    a->t = PyErr_Occurred() ? 0.0 : PyFloat_AsDouble(req[7]);
    a->base_lr = PyErr_Occurred() ? 0.0 : PyFloat_AsDouble(req[8]);
    return PyErr_Occurred() ? -1 : 0;
}

/* Every tensor argument: the lists, then lr, loss, grad_scale, skip, context. */
static int
import_cms(py_batch *b, PyObject *const o[10], PyObject *const opt[4], tm_cms_tensors *t,
           tm_cms_inputs *in, Py_ssize_t *k)
{
    tm_tensor_list *levels[4] = {t->momentum, t->accumulated, t->ema, t->v_sq};
    if (py_import_list(b, o[0], "params", 0, &t->params) < 0 ||
        py_import_list(b, o[1], "grads", 0, &t->grads) < 0) {
        return -1;
    }
    for (int r = 0; r < 4; r++) {
        if (import_levels(b, o[2 + r], r, k, levels[r]) < 0) {
            return -1;
        }
    }
    return py_import_list(b, o[6], "step_counts", 0, &t->step_counts) < 0 ||
                   py_import(b, o[7], "lr", -1, 0, &in->lr, NULL, NULL) < 0 ||
                   py_import_list(b, o[9], "weights", 0, &t->weights) < 0 ||
                   py_import_optional(b, opt[0], "loss", &in->loss) < 0 ||
                   py_import_optional(b, opt[1], "grad_scale", &in->grad_scale) < 0 ||
                   py_import_optional(b, opt[2], "skip", &in->skip) < 0 ||
                   py_import_optional(b, opt[3], "context", &in->context) < 0
               ? -1
               : 0;
}

PyObject *
py_cms_step(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {
        "params", "grads", "momentum", "accumulated", "ema", "v_sq", "step_counts", "lr",
        "group_of", "weights", "fires", "divisors", "ema_decays", "net", "hidden", "layers",
        "weight_decay", "t", "base_lr", "loss", "grad_scale", "skip", "context", "beta2",
        "momentum_coef", "clamp_ratio", "num_threads", "stream", "scratch", "check_only", NULL};
    PyObject *o[10], *req[10] = {NULL}, *grad_scale = Py_None, *skip = Py_None;
    PyObject *context = Py_None;
    PyObject *stream = Py_None, *scratch = Py_None;
    tm_cms_args a = {.beta2 = 0.999, .momentum_coef = 0.9, .clamp_ratio = 100.0};
    int num_threads = 1, check_only = 0;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "OOOOOOOOOO|$OOOOOOOOOOOOOdddiOOp:cms_step", kwlist, &o[0], &o[1],
            &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &o[9], &req[0], &req[1], &req[2],
            &req[3], &req[4], &req[5], &req[6], &req[7], &req[8], &req[9], &grad_scale, &skip,
            &context, &a.beta2, &a.momentum_coef, &a.clamp_ratio, &num_threads, &stream, &scratch,
            &check_only) ||
        cms_required(req, &a) < 0) {
        return NULL;
    }
    py_batch b;
    py_call c = {.heap = NULL};
    tm_cms_tensors t;
    tm_cms_inputs in;
    tm_status status = TM_OK;
    int ran = 0;
    Py_ssize_t k = -1;
    PyObject *const opt[4] = {req[9], grad_scale, skip, context};
    memset(&t, 0, sizeof t);
    py_batch_init(&b, py_get_state(module));
    /* the numbers first: their conversions (__bool__, __float__) may run Python code, which
     * must not run once a tensor is imported (it could resize that tensor's storage) */
    if (level_count(o[2], role_names[0], "lists of tensors", &k) < 0 ||
        parse_level_numbers(req, k, &a) < 0 || import_cms(&b, o, opt, &t, &in, &k) < 0 ||
        py_parse_ints(&b, o[8], "group_of", t.params.count, "params", &a.group_of) < 0) {
        goto done;
    }
    a.levels = (int32_t)k;
    a.num_groups = in.lr.numel <= INT32_MAX ? (int32_t)in.lr.numel : -1;
    if (py_setup_call(&b, py_first_or(&t.params, &in.lr), num_threads, stream, scratch,
                      tm_cms_scratch_bytes(&t.params, a.levels, a.net), "cms_scratch_bytes",
                      &c) < 0) {
        goto done;
    }
    if (check_only) {
        PY_RUN(c, status, tm_cms_check(&t, &a, &in, &c.ex));
    } else {
        PY_RUN(c, status, tm_cms_step(&t, &a, &in, &c.ex));
    }
    ran = 1;
done:
    return py_finish(&b, &c, ran, status);
}

PyObject *
py_cms_scratch_bytes(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"params", "levels", "net", NULL};
    PyObject *params, *levels = NULL, *net_obj = NULL, *result = NULL;
    tm_cms_net net;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$OO:cms_scratch_bytes", kwlist, &params,
                                     &levels, &net_obj)) {
        return NULL;
    }
    if (levels == NULL || net_obj == NULL) {
        PyErr_Format(PyExc_TypeError,
                     "cms_scratch_bytes() missing required keyword-only argument: '%s'",
                     levels == NULL ? "levels" : "net");
        return NULL;
    }
    long k = PyLong_AsLong(levels);
    if ((k == -1 && PyErr_Occurred()) || parse_net(net_obj, &net) < 0) {
        return NULL;
    }
    if (k < 1 || k > TM_CMS_MAX_LEVELS) {
        PyErr_Format(PyExc_ValueError, "levels = %ld: must be in [1, %d]", k, TM_CMS_MAX_LEVELS);
        return NULL;
    }
    py_batch b;
    tm_tensor_list p;
    py_batch_init(&b, py_get_state(module));
    if (py_import_list(&b, params, "params", 0, &p) == 0) {
        result = PyLong_FromSize_t(tm_cms_scratch_bytes(&p, (int32_t)k, net));
    }
    py_batch_release(&b);
    return result;
}

/* ---------------------------------------------------------------- cms_surrogate ---- */

/* divisor, hidden, layers (keyword-only, required). */
static int
surrogate_required(PyObject *const req[3], tm_cms_surrogate_args *a)
{
    static const char *const names[3] = {"divisor", "hidden", "layers"};
    for (int k = 0; k < 3; k++) {
        if (req[k] == NULL) {
            PyErr_Format(PyExc_TypeError,
                         "cms_surrogate() missing required keyword-only argument: '%s'", names[k]);
            return -1;
        }
    }
    a->divisor = PyFloat_AsDouble(req[0]);
    long h = PyErr_Occurred() ? -1 : PyLong_AsLong(req[1]);
    long l = PyErr_Occurred() ? -1 : PyLong_AsLong(req[2]);
    if (PyErr_Occurred()) {
        return -1;
    }
    a->hidden = h < INT32_MIN || h > INT32_MAX ? -1 : (int32_t)h;
    a->layers = l < INT32_MIN || l > INT32_MAX ? -1 : (int32_t)l;
    return 0;
}

PyObject *
py_cms_surrogate(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"targets", "momentum", "outputs", "weights", "weight_grads",
                             "losses", "divisor", "hidden", "layers", "has_prev", "scale",
                             "num_threads", "stream", "scratch", NULL};
    static const char *const list_names[5] = {"targets", "momentum", "outputs", "weights",
                                              "weight_grads"};
    PyObject *o[6], *req[3] = {NULL}, *has_prev = Py_None, *scale = Py_None;
    PyObject *stream = Py_None, *scratch = Py_None;
    tm_cms_surrogate_args a = {.has_prev = NULL};
    int num_threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO|$OOOOOiOO:cms_surrogate", kwlist,
                                     &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &req[0], &req[1],
                                     &req[2], &has_prev, &scale, &num_threads, &stream,
                                     &scratch) ||
        surrogate_required(req, &a) < 0) {
        return NULL;
    }
    py_batch b;
    py_call c = {.heap = NULL};
    tm_cms_surrogate_tensors t;
    tm_cms_surrogate_inputs in;
    tm_tensor_list *lists[5] = {&t.targets, &t.momentum, &t.outputs, &t.weights, &t.weight_grads};
    tm_status status = TM_OK;
    int ran = 0;
    memset(&t, 0, sizeof t);
    memset(&in, 0, sizeof in);
    py_batch_init(&b, py_get_state(module));
    for (int k = 0; k < 5; k++) {
        if (py_import_list(&b, o[k], list_names[k], 0, lists[k]) < 0) {
            goto done;
        }
    }
    if (py_import(&b, o[5], "losses", -1, 0, &in.losses, NULL, NULL) < 0 ||
        py_import_optional(&b, scale, "scale", &in.scale) < 0 ||
        py_parse_ints(&b, has_prev, "has_prev", t.targets.count, "targets", &a.has_prev) < 0 ||
        py_setup_call(&b, py_first_or(&t.targets, &in.losses), num_threads, stream, scratch,
                      tm_cms_surrogate_scratch_bytes(&t.targets, a.layers),
                      "cms_surrogate_scratch_bytes", &c) < 0) {
        goto done;
    }
    PY_RUN(c, status, tm_cms_surrogate(&t, &a, &in, &c.ex));
    ran = 1;
done:
    return py_finish(&b, &c, ran, status);
}

PyObject *
py_cms_surrogate_scratch_bytes(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"targets", "layers", NULL};
    PyObject *targets, *result = NULL;
    int layers = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$i:cms_surrogate_scratch_bytes", kwlist,
                                     &targets, &layers)) {
        return NULL;
    }
    if (layers < 1 || layers > TM_CMS_MAX_LAYERS) {
        PyErr_Format(PyExc_ValueError, "layers = %d: must be in [1, %d]", layers,
                     TM_CMS_MAX_LAYERS);
        return NULL;
    }
    py_batch b;
    tm_tensor_list p;
    py_batch_init(&b, py_get_state(module));
    if (py_import_list(&b, targets, "targets", 0, &p) == 0) {
        result = PyLong_FromSize_t(tm_cms_surrogate_scratch_bytes(&p, (int32_t)layers));
    }
    py_batch_release(&b);
    return result;
}
