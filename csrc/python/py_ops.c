/*
 * py_ops.c -- one wrapper per function of titanmac.h: parse the arguments, import every tensor of
 * every list (dlpack_import.c), make one tm_* call -- with the GIL released when the tensors are on
 * the CPU -- release the imports, then map the status to an exception (py_call.c). Validation of
 * counts, numels, dtypes, devices and hyperparameters is the C core's; here only what the core
 * cannot see: Python types and the length of host arrays. The call's device is the first tensor's
 * (the core rejects mixed devices).
 */
#include "py_call.h"
#include "tm_tensor.h"

#include <string.h>

/* ---------------------------------------------------------------- AdamW ---- */

static int
import_adamw_lists(py_batch *b, PyObject *const lists[6], tm_adamw_tensors *t)
{
    return py_import_list(b, lists[0], "params", 0, &t->params) < 0 ||
                   py_import_list(b, lists[1], "grads", 0, &t->grads) < 0 ||
                   py_import_list(b, lists[2], "exp_avg", 0, &t->exp_avg) < 0 ||
                   py_import_list(b, lists[3], "exp_avg_sq", 0, &t->exp_avg_sq) < 0 ||
                   py_import_list(b, lists[4], "max_exp_avg_sq", 1, &t->max_exp_avg_sq) < 0 ||
                   py_import_list(b, lists[5], "step", 0, &t->step) < 0
               ? -1
               : 0;
}

PyObject *
py_adamw_step(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
                             "steps", "lr", "groups", "group_of", "amsgrad", "grad_scale", "skip",
                             "zero_grads_on_skip", "loss_scale", "num_threads", "stream", "scratch",
                             NULL};
    PyObject *l[6], *lr, *groups, *group_of = Py_None, *grad_scale = Py_None, *skip = Py_None;
    PyObject *loss_scale = Py_None, *stream = Py_None, *scratch = Py_None;
    int amsgrad = 0, zero_grads = 0, num_threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOO|O$pOOpOiOO:adamw_step", kwlist,
                                     &l[0], &l[1], &l[2], &l[3], &l[4], &l[5], &lr, &groups,
                                     &group_of, &amsgrad, &grad_scale, &skip, &zero_grads,
                                     &loss_scale, &num_threads, &stream, &scratch)) {
        return NULL;
    }
    py_batch b;
    py_call c = {.heap = NULL};
    tm_adamw_tensors t;
    tm_adamw_args a = {.amsgrad = amsgrad, .zero_grads_on_skip = zero_grads};
    tm_adamw_inputs in;
    tm_status status = TM_OK;
    int ran = 0;
    py_batch_init(&b, py_get_state(module));
    /* the groups first: float() of an entry may run Python code, which must not run once a
     * tensor is imported (it could resize that tensor's storage) */
    if (py_parse_groups(&b, groups, &a) < 0 || import_adamw_lists(&b, l, &t) < 0 ||
        py_import(&b, lr, "lr", -1, 0, &in.lr, NULL, NULL) < 0 ||
        py_import_optional(&b, grad_scale, "grad_scale", &in.grad_scale) < 0 ||
        py_import_optional(&b, skip, "skip", &in.skip) < 0 ||
        py_import_optional(&b, loss_scale, "loss_scale", &in.loss_scale) < 0 ||
        py_parse_ints(&b, group_of, "group_of", t.params.count, "params", &a.group_of) < 0 ||
        py_setup_call(&b, py_first_or(&t.params, &in.lr), num_threads, stream, scratch,
                      tm_adamw_scratch_bytes(&t), "adamw_scratch_bytes", &c) < 0) {
        goto done;
    }
    PY_RUN(c, status, tm_adamw_step(&t, &a, &in, &c.ex));
    ran = 1;
done:
    return py_finish(&b, &c, ran, status);
}

PyObject *
py_adamw_scratch_bytes(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
                             "steps", NULL};
    PyObject *l[6];
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO:adamw_scratch_bytes", kwlist, &l[0],
                                     &l[1], &l[2], &l[3], &l[4], &l[5])) {
        return NULL;
    }
    py_batch b;
    tm_adamw_tensors t;
    PyObject *result = NULL;
    py_batch_init(&b, py_get_state(module));
    if (import_adamw_lists(&b, l, &t) == 0) {
        result = PyLong_FromSize_t(tm_adamw_scratch_bytes(&t));
    }
    py_batch_release(&b);
    return result;
}

/* ---------------------------------------------------------------- norms, clip, scale ---- */

/* result_dtype= of norms: None (the norm as stored) or a dtype's name ("float16", ...). */
static int
parse_result_dtype(PyObject *obj, tm_dtype *out)
{
    *out = TM_FLOAT32;
    if (obj == Py_None) {
        return 0;
    }
    const char *name = PyUnicode_Check(obj) ? PyUnicode_AsUTF8AndSize(obj, NULL) : NULL;
    if (name == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "result_dtype: expected None or a dtype name, got %.100s",
                         PY_TYPE_NAME(obj));
        }
        return -1;
    }
    for (int d = 0; d < TM_DTYPE_COUNT; d++) {
        if (strcmp(name, tm_dtype_name((tm_dtype)d)) == 0) {
            *out = (tm_dtype)d;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "result_dtype = '%.100s': expected float32, float16, bfloat16 "
                 "or float64", name);
    return -1;
}

PyObject *
py_norms(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"grads", "params", "group_grad", "total_grad", "group_param",
                             "total_param", "nonfinite", "group_of", "num_groups", "norm_type",
                             "num_threads", "stream", "scratch", "coef", "max_norm",
                             "result_dtype", NULL};
    PyObject *grads, *params, *group_grad, *total_grad, *group_param = Py_None;
    PyObject *total_param = Py_None, *nonfinite = Py_None, *group_of = Py_None;
    PyObject *stream = Py_None, *scratch = Py_None, *coef = Py_None, *result_dtype = Py_None;
    tm_norms_args a = {.norm_type = 2.0, .num_groups = 1, .group_of = NULL, .max_norm = 0.0};
    int num_threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|$OOOOidiOOOdO:norms", kwlist, &grads,
                                     &params, &group_grad, &total_grad, &group_param,
                                     &total_param, &nonfinite, &group_of, &a.num_groups,
                                     &a.norm_type, &num_threads, &stream, &scratch, &coef,
                                     &a.max_norm, &result_dtype) ||
        parse_result_dtype(result_dtype, &a.result_dtype) < 0) {
        return NULL;
    }
    py_batch b;
    py_call c = {.heap = NULL};
    tm_tensor_list g, p;
    tm_norms_out out;
    tm_status status = TM_OK;
    int ran = 0;
    py_batch_init(&b, py_get_state(module));
    if (py_import_list(&b, grads, "grads", 0, &g) < 0 ||
        py_import_list(&b, params, "params", 1, &p) < 0 ||
        py_import(&b, group_grad, "group_grad", -1, 0, &out.group_grad, NULL, NULL) < 0 ||
        py_import(&b, total_grad, "total_grad", -1, 0, &out.total_grad, NULL, NULL) < 0 ||
        py_import_optional(&b, group_param, "group_param", &out.group_param) < 0 ||
        py_import_optional(&b, total_param, "total_param", &out.total_param) < 0 ||
        py_import_optional(&b, nonfinite, "nonfinite", &out.nonfinite) < 0 ||
        py_import_optional(&b, coef, "coef", &out.coef) < 0 ||
        py_parse_ints(&b, group_of, "group_of", g.count, "grads", &a.group_of) < 0) {
        goto done;
    }
    const tm_tensor_list *pp = params == Py_None ? NULL : &p;
    if (py_setup_call(&b, py_first_or(&g, &out.group_grad), num_threads, stream, scratch,
                      tm_norms_scratch_bytes(&g, pp), "norms_scratch_bytes", &c) < 0) {
        goto done;
    }
    PY_RUN(c, status, tm_norms(&g, pp, &a, &out, &c.ex));
    ran = 1;
done:
    return py_finish(&b, &c, ran, status);
}

PyObject *
py_norms_scratch_bytes(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"grads", "params", NULL};
    PyObject *grads, *params = Py_None, *result = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:norms_scratch_bytes", kwlist, &grads,
                                     &params)) {
        return NULL;
    }
    py_batch b;
    tm_tensor_list g, p;
    py_batch_init(&b, py_get_state(module));
    if (py_import_list(&b, grads, "grads", 0, &g) == 0 &&
        py_import_list(&b, params, "params", 1, &p) == 0) {
        result = PyLong_FromSize_t(tm_norms_scratch_bytes(&g, params == Py_None ? NULL : &p));
    }
    py_batch_release(&b);
    return result;
}

PyObject *
py_clip_coef(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"total_norm", "max_norm", "coef", "stream", NULL};
    PyObject *total_norm, *coef, *stream = Py_None;
    double max_norm;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OdO|$O:clip_coef", kwlist, &total_norm,
                                     &max_norm, &coef, &stream)) {
        return NULL;
    }
    py_batch b;
    py_call c = {.heap = NULL};
    tm_tensor n, k;
    tm_status status = TM_OK;
    int ran = 0;
    py_batch_init(&b, py_get_state(module));
    if (py_import(&b, total_norm, "total_norm", -1, 0, &n, NULL, NULL) < 0 ||
        py_import(&b, coef, "coef", -1, 0, &k, NULL, NULL) < 0 ||
        py_setup_call(&b, &n, 1, stream, Py_None, 0, "", &c) < 0) {
        goto done;
    }
    /* two scalars: not worth releasing the GIL */
    status = tm_clip_coef(&n, max_norm, &k, &c.ex);
    ran = 1;
done:
    return py_finish(&b, &c, ran, status);
}

PyObject *
py_scale(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"tensors", "scale", "num_threads", "stream", NULL};
    PyObject *tensors, *scale, *stream = Py_None;
    int num_threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|$iO:scale_", kwlist, &tensors, &scale,
                                     &num_threads, &stream)) {
        return NULL;
    }
    py_batch b;
    py_call c = {.heap = NULL};
    tm_tensor_list t;
    tm_tensor s;
    tm_status status = TM_OK;
    int ran = 0;
    py_batch_init(&b, py_get_state(module));
    if (py_import_list(&b, tensors, "tensors", 0, &t) < 0 ||
        py_import(&b, scale, "scale", -1, 0, &s, NULL, NULL) < 0 ||
        py_setup_call(&b, py_first_or(&t, &s), num_threads, stream, Py_None, 0, "", &c) < 0) {
        goto done;
    }
    PY_RUN(c, status, tm_scale(&t, &s, &c.ex));
    ran = 1;
done:
    return py_finish(&b, &c, ran, status);
}

/* ---------------------------------------------------------------- DeepNestedOptimizer ---- */

/* The keyword-only arguments without a default, obj[k] named names[k] (PyArg_Parse* has no
 * required keyword-only arguments): NULL after parsing means missing, reported as CPython
 * reports it. Order: hidden, layers, update_controller, first_step, check_loss, base_lr,
 * max_grad_norm. */
static int
dno_required(PyObject *const obj[7], char *const names[7], tm_dno_control_args *a)
{
    for (int k = 0; k < 7; k++) {
        if (obj[k] == NULL) {
            PyErr_Format(PyExc_TypeError,
                         "dno_control() missing required keyword-only argument: '%s'", names[k]);
            return -1;
        }
    }
    int v[5];
    for (int k = 0; k < 5; k++) {
        long x = k < 2 ? PyLong_AsLong(obj[k]) : PyObject_IsTrue(obj[k]);
        if (x == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (x < INT32_MIN || x > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "%s = %ld: out of range", names[k], x);
            return -1;
        }
        v[k] = (int)x;
    }
    a->hidden = v[0];
    a->layers = v[1];
    a->update_controller = v[2];
    a->first_step = v[3];
    a->check_loss = v[4];
    a->base_lr = PyFloat_AsDouble(obj[5]);
    if (a->base_lr == -1.0 && PyErr_Occurred()) {
        return -1; /* before the next conversion runs Python code with an exception set */
    }
    a->max_grad_norm = PyFloat_AsDouble(obj[6]);
    return PyErr_Occurred() ? -1 : 0;
}

PyObject *
py_dno_control(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"group_grad", "group_param", "total_grad", "depths", "loss",
                             "weights", "mu", "ema", "lr", "coef", "skip", "hidden", "layers",
                             "update_controller", "first_step", "check_loss", "base_lr",
                             "max_grad_norm", "ema_beta", "mu_min", "mu_max", "stream",
                             "previous", NULL};
    PyObject *o[11], *req[7] = {NULL}, *stream = Py_None, *previous = Py_None;
    tm_dno_control_args a = {.ema_beta = 0.1, .mu_min = 0.1, .mu_max = 2.0};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOOOOO|$OOOOOOOdddOO:dno_control",
                                     kwlist, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7],
                                     &o[8], &o[9], &o[10], &req[0], &req[1], &req[2], &req[3],
                                     &req[4], &req[5], &req[6], &a.ema_beta, &a.mu_min, &a.mu_max,
                                     &stream, &previous) ||
        dno_required(req, &kwlist[11], &a) < 0) {
        return NULL;
    }
    py_batch b;
    py_call c = {.heap = NULL};
    tm_dno_control_tensors t;
    tm_tensor *lone[11] = {&t.group_grad, &t.group_param, &t.total_grad, &t.depths, &t.loss,
                           NULL, &t.mu, &t.ema, &t.lr, &t.coef, &t.skip};
    tm_status status = TM_OK;
    int ran = 0;
    py_batch_init(&b, py_get_state(module));
    for (int k = 0; k < 11; k++) { /* kwlist[k] names o[k] */
        int rc = k == 5 ? py_import_list(&b, o[k], kwlist[k], 0, &t.weights)
                        : py_import(&b, o[k], kwlist[k], -1, 0, lone[k], NULL, NULL);
        if (rc < 0) {
            goto done;
        }
    }
    if (py_import_optional(&b, previous, "previous", &t.previous) < 0) {
        goto done;
    }
    /* G is group_grad's length; the core checks every other [G] tensor against it */
    a.num_groups = t.group_grad.numel <= INT32_MAX ? (int32_t)t.group_grad.numel : -1;
    if (py_setup_call(&b, &t.group_grad, 1, stream, Py_None, 0, "", &c) < 0) {
        goto done;
    }
    PY_RUN(c, status, tm_dno_control(&t, &a, &c.ex));
    ran = 1;
done:
    return py_finish(&b, &c, ran, status);
}

/* ---------------------------------------------------------------- introspection ---- */

PyObject *
py_select_cpu_isa(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"name", NULL};
    const char *name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "z:_select_cpu_isa", kwlist, &name)) {
        return NULL;
    }
    tm_status status = tm_cpu_select_isa(name);
    if (status != TM_OK) {
        return py_raise_status(py_get_state(module), status);
    }
    Py_RETURN_NONE;
}

PyObject *
py_dlpack_intake(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"obj", NULL};
    PyObject *obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:dlpack_intake", kwlist, &obj)) {
        return NULL;
    }
    py_state *st = py_get_state(module);
    if (obj == Py_None) {
        return PyUnicode_FromString(st->intake_protocol ? "protocol" : "exchange");
    }
    if (PyCapsule_CheckExact(obj)) {
        return PyUnicode_FromString("capsule");
    }
    return PyUnicode_FromString(py_exchange_api(st, Py_TYPE(obj)) ? "exchange" : "protocol");
}

PyObject *
py_import_info(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"obj", "name", NULL};
    static const char *const paths[] = {"exchange", "protocol", "capsule"};
    PyObject *obj;
    const char *name = "tensor";
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|s:_import", kwlist, &obj, &name)) {
        return NULL;
    }
    py_batch b;
    tm_tensor t;
    py_path path;
    py_batch_init(&b, py_get_state(module));
    PyObject *info = NULL;
    if (py_import(&b, obj, name, -1, 0, &t, &path, NULL) == 0) {
        char layout[TM_LAYOUT_TEXT]; /* before the release: the shape is borrowed */
        info = Py_BuildValue("{s:N,s:L,s:s,s:(ii),s:O,s:s,s:s}", "data",
                             PyLong_FromVoidPtr(t.data), "numel", (long long)t.numel, "dtype",
                             tm_dtype_name(t.dtype), "device", (int)t.device_type,
                             (int)t.device_id, "read_only",
                             (t.flags & TM_TENSOR_READ_ONLY) ? Py_True : Py_False, "path",
                             paths[path], "layout", tm_layout_text(&t, layout));
    }
    py_batch_release(&b);
    return info;
}
