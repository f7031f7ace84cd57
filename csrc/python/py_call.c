/*
 * py_call.c -- the parts every wrapper of py_ops.c shares: host arguments (AdamW groups,
 * group_of), the device, stream and scratch of a call, and the one status -> exception mapping:
 *   TM_ERR_VALUE -> ValueError, TM_ERR_TYPE -> TypeError, TM_ERR_BUFFER -> BufferError,
 *   anything else (unsupported, CUDA, internal) -> titanmac_c.Error; message tm_last_error().
 * On CUDA the stream is the producer's current stream from the exchange table when a tensor came
 * through one, else the `stream` keyword (an int cudaStream_t from the shim; 0 or None = the
 * default stream). Scratch: the `scratch` tensor when given (any dtype, its bytes count), else a
 * host buffer for the call on the CPU; on CUDA it must be given.
 */
#include "py_call.h"

#include "tm_tensor.h"

#include <stdlib.h>

PyObject *
py_raise_status(py_state *st, tm_status status)
{
    PyObject *type;
    switch (status) {
    case TM_ERR_VALUE:
        type = PyExc_ValueError;
        break;
    case TM_ERR_TYPE:
        type = PyExc_TypeError;
        break;
    case TM_ERR_BUFFER:
        type = PyExc_BufferError;
        break;
    default: /* TM_ERR_UNSUPPORTED, TM_ERR_CUDA, TM_ERR_INTERNAL */
        type = st->error;
        break;
    }
    const char *msg = tm_last_error();
    if (msg == NULL || msg[0] == '\0') {
        PyErr_Format(type, "titanmac_c: status %d", (int)status);
    } else {
        PyErr_SetString(type, msg);
    }
    return NULL;
}

/* ---------------------------------------------------------------- host arguments ---- */

int
py_parse_groups(py_batch *b, PyObject *groups, tm_adamw_args *a)
{
    if (!PyList_Check(groups) && !PyTuple_Check(groups)) {
        PyErr_Format(PyExc_TypeError, "groups: expected a list of tuples, got %.100s",
                     PY_TYPE_NAME(groups));
        return -1;
    }
    PyObject *seq = PySequence_Tuple(groups); /* float() of an entry may run Python code */
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t n = PyTuple_Size(seq);
    tm_adamw_group *g = n <= INT32_MAX ? py_batch_alloc(b, (size_t)n * sizeof *g) : NULL;
    for (Py_ssize_t i = 0; g != NULL && i < n; i++) {
        PyObject *tup = PySequence_Tuple(PyTuple_GetItem(seq, i));
        double v[4];
        int ok = tup != NULL && PyTuple_Size(tup) == 5, maximize = -1;
        for (int k = 0; ok && k < 4; k++) {
            v[k] = PyFloat_AsDouble(PyTuple_GetItem(tup, k));
            ok = !(v[k] == -1.0 && PyErr_Occurred());
        }
        if (ok) {
            maximize = PyObject_IsTrue(PyTuple_GetItem(tup, 4));
        }
        Py_XDECREF(tup);
        if (maximize < 0) {
            PyErr_Format(PyExc_TypeError,
                         "groups[%zd]: expected a tuple of floats (beta1, beta2, eps, "
                         "weight_decay, maximize)",
                         i);
            g = NULL;
            break;
        }
        g[i] = (tm_adamw_group){v[0], v[1], v[2], v[3], maximize};
    }
    Py_DECREF(seq);
    if (g == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "groups: too many groups");
        }
        return -1;
    }
    a->groups = g;
    a->num_groups = (int32_t)n;
    return 0;
}

int
py_parse_ints(py_batch *b, PyObject *obj, const char *name, int32_t count, const char *of,
              const int32_t **out)
{
    *out = NULL;
    if (obj == Py_None) {
        return 0;
    }
    if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a list of ints or None, got %.100s", name,
                     PY_TYPE_NAME(obj));
        return -1;
    }
    if (py_seq_size(obj) != count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd entries for %d %s", name,
                     py_seq_size(obj), (int)count, of);
        return -1;
    }
    int32_t *g = py_batch_alloc(b, (size_t)count * sizeof *g);
    if (g == NULL) {
        return -1;
    }
    for (int32_t i = 0; i < count; i++) {
        PyObject *item = py_seq_item(obj, i); /* exact ints run no Python code */
        if (!PyLong_Check(item)) { /* bools are ints */
            PyErr_Format(PyExc_TypeError, "%s[%d]: expected an int, got %.100s", name, (int)i,
                         PY_TYPE_NAME(item));
            return -1;
        }
        long v = PyLong_AsLong(item);
        if ((v == -1 && PyErr_Occurred()) || v < INT32_MIN || v > INT32_MAX) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s[%d]: out of range", name, (int)i);
            return -1;
        }
        g[i] = (int32_t)v;
    }
    *out = g;
    return 0;
}

/* ---------------------------------------------------------------- device, stream, scratch ---- */

static int
get_stream(py_batch *b, const tm_tensor *dev, PyObject *stream, void **out)
{
    *out = NULL;
    if (b->api != NULL && b->api->current_work_stream != NULL) {
        if (b->api->current_work_stream(kDLCUDA, dev->device_id, out) != 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(b->st->error, "current_work_stream of the DLPack table failed");
            }
            return -1;
        }
        return 0;
    }
    if (stream == Py_None) {
        return 0;
    }
    if (!PyLong_Check(stream) || PyLong_AsLongLong(stream) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "stream: expected an int >= 0 (cudaStream_t) or None");
        return -1;
    }
    *out = PyLong_AsVoidPtr(stream);
    return *out == NULL && PyErr_Occurred() ? -1 : 0;
}

static int
get_scratch(py_batch *b, const tm_tensor *dev, PyObject *scratch, size_t need, const char *sizer,
            py_call *c)
{
    const char *where = c->on_cpu ? "CPU" : "CUDA";
    if (scratch != Py_None) {
        tm_tensor t;
        size_t nbytes;
        if (py_import(b, scratch, "scratch", -1, PY_IMPORT_ANY_DTYPE, &t, NULL, &nbytes) < 0) {
            return -1;
        }
        if (t.flags & TM_TENSOR_READ_ONLY) {
            PyErr_SetString(PyExc_BufferError, "scratch: read-only");
            return -1;
        }
        if (!tm_same_device(&t, dev)) {
            char want[TM_DEVICE_TEXT], got[TM_DEVICE_TEXT];
            PyErr_Format(PyExc_BufferError, "scratch: on %s, but the tensors are on %s",
                         tm_device_text(&t, got), tm_device_text(dev, want));
            return -1;
        }
        if (nbytes < need) {
            PyErr_Format(PyExc_ValueError, "scratch: %s needs %zu bytes, got %zu (see %s)", where,
                         need, nbytes, sizer);
            return -1;
        }
        c->ex.scratch = t.data;
        c->ex.scratch_bytes = nbytes;
        return 0;
    }
    if (need == 0) {
        return 0;
    }
    if (!c->on_cpu) {
        PyErr_Format(PyExc_ValueError, "scratch: CUDA needs %zu bytes (see %s)", need, sizer);
        return -1;
    }
    c->heap = malloc(need);
    if (c->heap == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    c->ex.scratch = c->heap;
    c->ex.scratch_bytes = need;
    return 0;
}

int
py_setup_call(py_batch *b, const tm_tensor *dev, int num_threads, PyObject *stream,
              PyObject *scratch, size_t need, const char *sizer, py_call *c)
{
    c->on_cpu = dev->device_type != TM_DEVICE_CUDA;
    c->ex.num_threads = num_threads;
    c->ex.stream = NULL;
    c->ex.scratch = NULL;
    c->ex.scratch_bytes = 0;
    if (!c->on_cpu && get_stream(b, dev, stream, &c->ex.stream) < 0) {
        return -1;
    }
    return get_scratch(b, dev, scratch, need, sizer, c);
}

/* per thread: a call completed by another thread must not read as this thread's */
static _Thread_local unsigned long long completed_calls;

unsigned long long
py_completed_calls(void)
{
    return completed_calls;
}

PyObject *
py_completed_calls_object(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromUnsignedLongLong(completed_calls);
}

PyObject *
py_run_counted(PyObject *module, PyObject *args, PyObject *kwargs)
{
    (void)module;
    Py_ssize_t n = PyTuple_Size(args);
    if (n < 1) {
        PyErr_SetString(PyExc_TypeError, "run_counted(fn, *args, **kwargs): no fn");
        return NULL;
    }
    PyObject *rest = PyTuple_GetSlice(args, 1, n);
    if (rest == NULL) {
        return NULL;
    }
    /* no Python code runs between fn's return and the count: a pending signal is raised only
     * after this function returns */
    PyObject *result = PyObject_Call(PyTuple_GetItem(args, 0), rest, kwargs);
    Py_DECREF(rest);
    if (result != NULL) {
        completed_calls++;
    }
    return result;
}

PyObject *
py_finish(py_batch *b, py_call *c, int ran, tm_status status)
{
    py_batch_release(b);
    free(c->heap);
    if (!ran) {
        return NULL;
    }
    if (status != TM_OK) {
        return py_raise_status(b->st, status);
    }
    completed_calls++;
    Py_RETURN_NONE;
}
