/*
 * dlpack_check.c -- what a DLPack producer offers and what its tensors mean to titanmac_c.
 * The exchange table of a type (`__dlpack_c_exchange_api__`, DLPack 1.3; the 1.2-era
 * `__c_dlpack_exchange_api__`), looked up once per type; an object's __dlpack_device__(). One
 * DLTensor (+ flags) becomes a tm_tensor after the checks every consumer makes (numpy dlpack.c,
 * nanobind, section 6 of docs/dlpack.md): device (cpu, pinned host, or cuda), dtype (float32,
 * float16, bfloat16; lanes 1), shape (which the tm_tensor keeps), layout (C-contiguous ignoring
 * size-1 dims, whose strides torch <= 2.9 rewrote to 1, NULL strides = compact; or dense in another
 * order, whose strides the tm_tensor keeps), data + byte_offset, READ_ONLY. And the labelled errors
 * ("grads[3]: ...") of the importer. No ownership here: that is dlpack_import.c's.
 */
#include "dlpack_import.h"
#include "tm_tensor.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- errors ---- */

int
py_fail(PyObject *type, py_label lbl, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (lbl.index >= 0) {
        PyErr_Format(type, "%s[%zd]: %s", lbl.name, lbl.index, msg);
    } else {
        PyErr_Format(type, "%s: %s", lbl.name, msg);
    }
    return -1;
}

const char *
py_type_name(PyObject *obj, char buf[PY_TYPE_NAME_MAX])
{
    PyObject *type = (PyObject *)Py_TYPE(obj), *err_type, *err_value, *err_tb;
    PyErr_Fetch(&err_type, &err_value, &err_tb);
    PyObject *name = PyObject_GetAttrString(type, "__name__");
    /* a C type's tp_name carries its module ("torch.dtype"), a builtin's and a class's do not */
    PyObject *module = PyType_GetFlags(Py_TYPE(obj)) & Py_TPFLAGS_HEAPTYPE
                           ? NULL
                           : PyObject_GetAttrString(type, "__module__");
    const char *n = name != NULL && PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, NULL)
                                                          : NULL;
    const char *m = module != NULL && PyUnicode_Check(module)
                        ? PyUnicode_AsUTF8AndSize(module, NULL)
                        : NULL;
    if (m != NULL && strcmp(m, "builtins") != 0) {
        snprintf(buf, PY_TYPE_NAME_MAX, "%s.%s", m, n != NULL ? n : "?");
    } else {
        snprintf(buf, PY_TYPE_NAME_MAX, "%s", n != NULL ? n : "?");
    }
    Py_XDECREF(name);
    Py_XDECREF(module);
    PyErr_Restore(err_type, err_value, err_tb); /* drops an error of the lookups themselves */
    return buf;
}

PyObject *
py_take_exception(void)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL) {
        PyException_SetTraceback(value, tb);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

void
py_restore_exception(PyObject *exc)
{
    if (exc == NULL) {
        return;
    }
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
}

int
py_fail_from_pending(PyObject *type, py_label lbl, const char *what)
{
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception)) {
        return -1;
    }
    PyObject *cause = py_take_exception();
    PyObject *text = cause != NULL ? PyObject_Str(cause) : NULL;
    const char *utf8 = text != NULL ? PyUnicode_AsUTF8AndSize(text, NULL) : NULL;
    PyErr_Clear();
    utf8 = utf8 != NULL ? utf8 : "no details";
    /* first line only: torch appends a C++ backtrace (the chained cause keeps all of it) */
    py_fail(type, lbl, "%s: %.*s", what, (int)strcspn(utf8, "\n"), utf8);
    Py_XDECREF(text);
    if (cause != NULL) {
        PyObject *exc = py_take_exception();
        PyException_SetCause(exc, cause); /* steals cause */
        py_restore_exception(exc);
    }
    return -1;
}

/* ---------------------------------------------------------------- exchange table ---- */

/* A chain holds one table per DLPack version a producer serves: a few. The bound ends the walk
 * of a chain that points back into itself, which would otherwise spin with the GIL held. */
#define TM_EXCHANGE_CHAIN_MAX 16

/* A table pointer (capsule payload or int) -> the major-1 table in its chain, or NULL. The
 * pointer is the producer's word, as a DLPack capsule's data pointer is. */
static const DLPackExchangeAPI *
usable_table(const void *ptr)
{
    const DLPackExchangeAPIHeader *h = ptr;
    for (int hops = 0; h != NULL && hops < TM_EXCHANGE_CHAIN_MAX; h = h->prev_api, hops++) {
        if (h->version.major == TM_DLPACK_MAJOR) {
            const DLPackExchangeAPI *api = (const DLPackExchangeAPI *)h;
            int can_read = api->dltensor_from_py_object_no_sync != NULL ||
                           api->managed_tensor_from_py_object_no_sync != NULL;
            return can_read ? api : NULL;
        }
    }
    return NULL;
}

/* DLPack 1.3 names the attribute __dlpack_c_exchange_api__ (capsule "dlpack_exchange_api");
 * 1.2-era producers set __c_dlpack_exchange_api__ as an int or a capsule (as tvm-ffi accepts).
 * *owner: a new reference to the attribute that gave the table, NULL when there is none. */
static const DLPackExchangeAPI *
lookup_table(py_state *st, PyTypeObject *type, PyObject **owner)
{
    const void *ptr = NULL;
    PyObject *attr = PyObject_GetAttr((PyObject *)type, st->s_exchange_api);
    if (attr != NULL && PyCapsule_IsValid(attr, "dlpack_exchange_api")) {
        ptr = PyCapsule_GetPointer(attr, "dlpack_exchange_api");
    } else {
        Py_XDECREF(attr);
        PyErr_Clear();
        attr = PyObject_GetAttr((PyObject *)type, st->s_exchange_legacy);
        if (attr != NULL && PyCapsule_CheckExact(attr)) {
            ptr = PyCapsule_GetPointer(attr, PyCapsule_GetName(attr));
        } else if (attr != NULL && PyLong_Check(attr)) {
            ptr = PyLong_AsVoidPtr(attr);
        }
    }
    PyErr_Clear();
    const DLPackExchangeAPI *api = ptr != NULL ? usable_table(ptr) : NULL;
    if (api == NULL) {
        Py_CLEAR(attr);
    }
    *owner = attr;
    return api;
}

const DLPackExchangeAPI *
py_exchange_api(py_state *st, PyTypeObject *type)
{
    if (st->intake_protocol) {
        return NULL;
    }
    for (int i = 0; i < st->n_api; i++) {
        if (st->api_cache[i].type == type) {
            return st->api_cache[i].api;
        }
    }
    PyObject *owner;
    const DLPackExchangeAPI *api = lookup_table(st, type, &owner);
    int remember = api != NULL || !(PyType_GetFlags(type) & Py_TPFLAGS_HEAPTYPE);
    if (remember && st->n_api < PY_API_CACHE_SIZE) {
        py_api_entry *e = &st->api_cache[st->n_api++];
        e->type = (PyTypeObject *)Py_NewRef((PyObject *)type);
        e->api = api;
        e->owner = owner; /* the reference lookup_table gave */
    } else {
        Py_XDECREF(owner); /* not cached: a table of an uncached type is used for this call
                              only, while the type (and so its attribute) is alive */
    }
    return api;
}

/* ---------------------------------------------------------------- DLTensor -> tm_tensor ---- */

static const char *
dtype_name(DLDataType t, char *buf, size_t cap)
{
    static const char *const fp8[] = {"float8_e3m4",   "float8_e4m3",      "float8_e4m3b11fnuz",
                                      "float8_e4m3fn", "float8_e4m3fnuz",  "float8_e5m2",
                                      "float8_e5m2fnuz", "float8_e8m0fnu", "float6_e2m3fn",
                                      "float6_e3m2fn", "float4_e2m1fn"};
    static const char *const base[] = {"int", "uint", "float", NULL, "bfloat", "complex"};
    if (t.code == kDLBool) {
        return "bool";
    }
    if (t.code >= kDLFloat8_e3m4 && t.code <= kDLFloat4_e2m1fn) {
        return fp8[t.code - kDLFloat8_e3m4];
    }
    if (t.code <= kDLComplex && base[t.code] != NULL) {
        snprintf(buf, cap, "%s%u", base[t.code], (unsigned)t.bits);
    } else {
        snprintf(buf, cap, "(code %u, bits %u)", (unsigned)t.code, (unsigned)t.bits);
    }
    return buf;
}

/* (2,32) float32, (2,16) float16, (4,16) bfloat16, (2,64) float64 -> 1; anything else -> 0 (out:
 * float32, for scratch, where only the bytes matter). */
static int
known_dtype(DLDataType t, tm_dtype *out)
{
    *out = TM_FLOAT32;
    if (t.code == kDLFloat && t.bits == 32) {
        return 1;
    }
    if (t.code == kDLFloat && t.bits == 64) {
        *out = TM_FLOAT64;
        return 1;
    }
    if (t.code == kDLFloat && t.bits == 16) {
        *out = TM_FLOAT16;
        return 1;
    }
    if (t.code == kDLBfloat && t.bits == 16) {
        *out = TM_BFLOAT16;
        return 1;
    }
    return 0;
}

/* C-contiguous, ignoring the strides of size-1 dims (torch <= 2.9 rewrote them to 1). */
static int
is_contiguous(const DLTensor *dl)
{
    int64_t expected = 1;
    for (int32_t d = dl->ndim - 1; d >= 0; d--) {
        if (dl->shape[d] != 1 && dl->strides[d] != expected) {
            return 0;
        }
        expected *= dl->shape[d];
    }
    return 1;
}

/* Dense in some order of its dimensions (channels_last, transposed): the strides of the
 * dimensions longer than 1, taken from the smallest, are 1, n, n * m, ... with n, m the sizes
 * before: every element on its own place and no gap. A stride matches at most one dimension
 * (the expected stride grows past each one used), so two dimensions on one stride fail. */
static int
is_dense(const DLTensor *dl)
{
    int32_t dims = 0;
    for (int32_t d = 0; d < dl->ndim; d++) {
        dims += dl->shape[d] > 1;
    }
    int64_t expected = 1;
    for (int32_t placed = 0; placed < dims; placed++) {
        int32_t d = 0;
        while (d < dl->ndim && !(dl->shape[d] > 1 && dl->strides[d] == expected)) {
            d++;
        }
        if (d == dl->ndim) {
            return 0;
        }
        expected *= dl->shape[d];
    }
    return 1;
}

int
py_check_dltensor(const DLTensor *dl, uint64_t flags, py_label lbl, unsigned opts, tm_tensor *out,
                  size_t *nbytes)
{
    char a[160], s[160];
    DLDataType t = dl->dtype;
    out->device_type = dl->device.device_type == kDLCUDA ? TM_DEVICE_CUDA : TM_DEVICE_CPU;
    out->device_id = dl->device.device_type == kDLCUDA ? dl->device.device_id : 0;
    if (dl->device.device_type != kDLCPU && dl->device.device_type != kDLCUDAHost &&
        dl->device.device_type != kDLCUDA) {
        return py_fail(PyExc_BufferError, lbl, "device type %d is not supported (cpu or cuda)",
                       (int)dl->device.device_type);
    }
    if (t.lanes != 1) {
        return py_fail(PyExc_BufferError, lbl, "dtype %s x%u (lanes) is not supported",
                       dtype_name(t, a, sizeof a), (unsigned)t.lanes);
    }
    if (!known_dtype(t, &out->dtype) && !(opts & PY_IMPORT_ANY_DTYPE)) {
        return py_fail(PyExc_BufferError, lbl,
                       "dtype %s is not supported (float32, float16, bfloat16, float64)",
                       dtype_name(t, a, sizeof a));
    }
    if (dl->ndim < 0 || (dl->ndim > 0 && dl->shape == NULL)) {
        return py_fail(PyExc_BufferError, lbl, "invalid DLTensor (ndim %d without a shape)",
                       (int)dl->ndim);
    }
    int64_t numel = 1;
    for (int32_t d = 0; d < dl->ndim; d++) {
        if (dl->shape[d] < 0 || __builtin_mul_overflow(numel, dl->shape[d], &numel)) {
            tm_dims_text(a, sizeof a, dl->shape, dl->ndim);
            return py_fail(PyExc_BufferError, lbl, "invalid shape %s", a);
        }
    }
    /* The shape always (borrowed from the producer until py_batch_release, as data is): the core
     * compares the shapes of tensors it pairs element by element, whose numels alone would let a
     * state made for a (4, 6) parameter step one reshaped to (6, 4). A 0-d tensor's may be NULL
     * (DLPack 1.3), which the core reads as "not given": it gets an empty array of its own. */
    static const int64_t no_dims[1] = {1};
    out->ndim = dl->ndim;
    out->shape = dl->ndim == 0 && dl->shape == NULL ? no_dims : dl->shape;
    out->strides = NULL; /* C-contiguous */
    if (numel > 1 && dl->strides != NULL && !is_contiguous(dl)) {
        if (!is_dense(dl)) {
            tm_dims_text(a, sizeof a, dl->shape, dl->ndim);
            tm_dims_text(s, sizeof s, dl->strides, dl->ndim);
            return py_fail(PyExc_BufferError, lbl,
                           "not contiguous, nor dense in another order (shape %s, strides %s)",
                           a, s);
        }
        out->strides = dl->strides; /* borrowed, as the shape */
    }
    if (numel > 0 && dl->data == NULL) {
        return py_fail(PyExc_BufferError, lbl, "data is NULL for %lld elements", (long long)numel);
    }
    out->data = dl->data != NULL ? (char *)dl->data + dl->byte_offset : NULL;
    out->numel = numel;
    /* A copy made by the producer is as good as read-only: writes would not reach the caller. */
    out->flags = (flags & (DLPACK_FLAG_BITMASK_READ_ONLY | DLPACK_FLAG_BITMASK_IS_COPIED))
                     ? TM_TENSOR_READ_ONLY
                     : 0u;
    if (nbytes != NULL) {
        *nbytes = (size_t)numel * (((size_t)t.bits * t.lanes + 7) / 8);
    }
    return 0;
}

/* DLPack device type from obj.__dlpack_device__() (kDLCPU when the producer has none). */
int
py_dlpack_device_type(py_state *st, PyObject *obj, py_label lbl, long *type)
{
    PyObject *dev = PyObject_CallMethodObjArgs(obj, st->s_dlpack_device, NULL);
    if (dev == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return py_fail_from_pending(PyExc_BufferError, lbl, "__dlpack_device__() failed");
        }
        PyErr_Clear();
        *type = kDLCPU;
        return 0;
    }
    *type = -1;
    if (PyTuple_Check(dev) && PyTuple_Size(dev) == 2) {
        *type = PyLong_AsLong(PyTuple_GetItem(dev, 0));
    }
    Py_DECREF(dev);
    if (*type == -1) {
        PyErr_Clear();
        return py_fail(PyExc_BufferError, lbl, "__dlpack_device__() did not return (type, id)");
    }
    return 0;
}
