/*
 * dlpack_import.c -- Python object -> tm_tensor, and every DLPack ownership rule of the project.
 *
 * Three ways in (docs/dlpack.md, sections 2, 4 and 8):
 *   exchange  the type carries the DLPack C exchange table (`__dlpack_c_exchange_api__`, torch >=
 *             2.10): dltensor_from_py_object_no_sync fills a stack DLTensor that borrows from the
 *             object (we hold a reference for the call); if the table lacks that slot,
 *             managed_tensor_from_py_object_no_sync gives an owned tensor (deleter at release).
 *   capsule   a "dltensor"/"dltensor_versioned" PyCapsule: consumed (renamed used_*), owned.
 *   protocol  obj.__dlpack__(stream=None on CPU, -1 on CUDA, max_version=(1, 3)), retried without
 *             max_version on TypeError (torch <= 2.8), and on obj.detach() on BufferError or
 *             RuntimeError (a tensor that requires grad); then the capsule rule.
 * Then py_check_dltensor (dlpack_check.c) checks device, dtype, layout and flags. Deleters run in
 * py_batch_release(), after the op and on every error path, with the GIL held (torch's deleter
 * may drop Python objects).
 *
 * Producers are trusted, as DLPack trusts them: an imported tensor's memory must stay where it
 * is until the op returns. Torch tensors on the exchange path run no Python code, but an
 * object's __dlpack__, __dlpack_device__ or detach() runs any: one that resizes or frees a
 * tensor imported before it in the same call leaves that import pointing at freed memory.
 */
#include "dlpack_import.h"
#include "tm_tensor.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- batch ---- */

void
py_batch_init(py_batch *b, py_state *st)
{
    b->st = st;
    b->api = NULL;
    b->refs = b->refs_inline;
    b->n_refs = 0;
    b->cap_refs = PY_BATCH_INLINE_REFS;
    b->owned = b->owned_inline;
    b->n_owned = 0;
    b->cap_owned = PY_BATCH_INLINE_OWNED;
    b->arena_used = 0;
    b->n_blocks = 0;
}

void
py_batch_release(py_batch *b)
{
    /* Deleters and decrefs may run Python code, which must not see the error being raised. */
    PyObject *pending = b->n_owned + b->n_refs > 0 ? py_take_exception() : NULL;
    for (Py_ssize_t i = 0; i < b->n_owned; i++) {
        if (b->owned[i].versioned) {
            DLManagedTensorVersioned *mt = b->owned[i].managed;
            if (mt->deleter != NULL) {
                mt->deleter(mt);
            }
        } else {
            DLManagedTensor *mt = b->owned[i].managed;
            if (mt->deleter != NULL) {
                mt->deleter(mt);
            }
        }
    }
    for (Py_ssize_t i = 0; i < b->n_refs; i++) {
        Py_DECREF(b->refs[i]);
    }
    if (b->refs != b->refs_inline) {
        PyMem_Free(b->refs);
    }
    if (b->owned != b->owned_inline) {
        PyMem_Free(b->owned);
    }
    for (int i = 0; i < b->n_blocks; i++) {
        PyMem_Free(b->blocks[i]);
    }
    py_batch_init(b, b->st);
    py_restore_exception(pending);
}

void *
py_batch_alloc(py_batch *b, size_t bytes)
{
    size_t size = (bytes + 15) & ~(size_t)15;
    if (size <= PY_BATCH_ARENA - b->arena_used) {
        void *p = b->arena + b->arena_used;
        b->arena_used += size;
        return p;
    }
    if (b->n_blocks == PY_BATCH_MAX_BLOCKS) {
        PyErr_SetString(PyExc_MemoryError, "titanmac_c: too many lists in one call");
        return NULL;
    }
    void *p = PyMem_Malloc(size);
    if (p == NULL) {
        return PyErr_NoMemory();
    }
    b->blocks[b->n_blocks++] = p;
    return p;
}

/* A copy of arr (used of *cap entries) with room for need, on the heap; frees arr unless it is
 * the inline storage inl. NULL with MemoryError set. */
static void *
grow(void *arr, const void *inl, Py_ssize_t used, Py_ssize_t *cap, Py_ssize_t need, size_t item)
{
    Py_ssize_t n = 2 * *cap > need ? 2 * *cap : need;
    void *p = PyMem_Malloc((size_t)n * item);
    if (p == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(p, arr, (size_t)used * item);
    if (arr != inl) {
        PyMem_Free(arr);
    }
    *cap = n;
    return p;
}

/* Room for `more` references (a whole list at once) and for one owned tensor. */
static int
reserve_refs(py_batch *b, Py_ssize_t more)
{
    if (b->n_refs + more <= b->cap_refs) {
        return 0;
    }
    PyObject **p = grow(b->refs, b->refs_inline, b->n_refs, &b->cap_refs, b->n_refs + more,
                        sizeof *p);
    b->refs = p != NULL ? p : b->refs;
    return p != NULL ? 0 : -1;
}

static int
reserve_owned(py_batch *b)
{
    if (b->n_owned < b->cap_owned) {
        return 0;
    }
    py_owned *p = grow(b->owned, b->owned_inline, b->n_owned, &b->cap_owned, b->n_owned + 1,
                       sizeof *p);
    b->owned = p != NULL ? p : b->owned;
    return p != NULL ? 0 : -1;
}

/* An owned versioned tensor: only its deleter may be touched unless the major version is ours. */
static int
take_versioned(const DLManagedTensorVersioned *mt, py_label lbl, DLTensor *dl, uint64_t *flags)
{
    if (mt->version.major != TM_DLPACK_MAJOR) {
        return py_fail(PyExc_BufferError, lbl, "DLPack major version %u is not supported (%d)",
                       (unsigned)mt->version.major, TM_DLPACK_MAJOR);
    }
    *dl = mt->dl_tensor;
    *flags = mt->flags;
    return 0;
}

/* ---------------------------------------------------------------- exchange ---- */

static int
import_exchange(py_batch *b, const DLPackExchangeAPI *api, PyObject *obj, py_label lbl,
                DLTensor *dl, uint64_t *flags)
{
    if (api->dltensor_from_py_object_no_sync != NULL) {
        if (reserve_refs(b, 1) < 0) {
            return -1;
        }
        if (api->dltensor_from_py_object_no_sync(obj, dl) != 0) {
            return py_fail_from_pending(PyExc_BufferError, lbl, "DLPack exchange API failed");
        }
        b->refs[b->n_refs++] = Py_NewRef(obj); /* dl borrows shape, strides and data from obj */
        *flags = 0;
    } else {
        DLManagedTensorVersioned *mt = NULL;
        if (reserve_owned(b) < 0) {
            return -1;
        }
        if (api->managed_tensor_from_py_object_no_sync(obj, &mt) != 0) {
            return py_fail_from_pending(PyExc_BufferError, lbl, "DLPack exchange API failed");
        }
        b->owned[b->n_owned++] = (py_owned){mt, 1};
        if (take_versioned(mt, lbl, dl, flags) < 0) {
            return -1;
        }
    }
    if (b->api == NULL) {
        b->api = api;
    }
    return 0;
}

/* ---------------------------------------------------------------- capsules, protocol ---- */

/* Take ownership of a DLPack capsule: rename it used_*, remember the deleter. */
static int
consume_capsule(py_batch *b, PyObject *cap, py_label lbl, DLTensor *dl, uint64_t *flags)
{
    if (reserve_owned(b) < 0) {
        return -1;
    }
    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        DLManagedTensorVersioned *mt = PyCapsule_GetPointer(cap, "dltensor_versioned");
        if (PyCapsule_SetName(cap, "used_dltensor_versioned") < 0) {
            return -1;
        }
        b->owned[b->n_owned++] = (py_owned){mt, 1};
        if (take_versioned(mt, lbl, dl, flags) < 0) {
            return -1;
        }
        return 0;
    }
    if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *mt = PyCapsule_GetPointer(cap, "dltensor");
        if (PyCapsule_SetName(cap, "used_dltensor") < 0) {
            return -1;
        }
        b->owned[b->n_owned++] = (py_owned){mt, 0};
        *dl = mt->dl_tensor;
        *flags = 0; /* legacy capsules carry no flags: writable (torch <= 2.8 makes only these) */
        return 0;
    }
    const char *name = PyCapsule_GetName(cap);
    PyErr_Clear();
    if (name != NULL && strncmp(name, "used_", 5) == 0) {
        return py_fail(PyExc_BufferError, lbl, "DLPack capsule was already consumed");
    }
    return py_fail(PyExc_TypeError, lbl, "capsule \"%.100s\" is not a DLPack tensor",
                   name != NULL ? name : "");
}

static int import_protocol(py_batch *b, PyObject *obj, py_label lbl, int may_detach,
                           DLTensor *dl, uint64_t *flags);

/* obj.detach() through the protocol, after obj's __dlpack__ refused it (the pending error);
 * an object without detach() reports that refusal. */
static int
import_detached(py_batch *b, PyObject *obj, py_label lbl, DLTensor *dl, uint64_t *flags)
{
    PyObject *refusal = py_take_exception();
    PyObject *detach = PyObject_GetAttr(obj, b->st->s_detach);
    if (detach == NULL) {
        PyErr_Clear();
        py_restore_exception(refusal);
        return py_fail_from_pending(PyExc_BufferError, lbl, "__dlpack__() failed");
    }
    Py_XDECREF(refusal);
    PyObject *view = PyObject_CallNoArgs(detach);
    Py_DECREF(detach);
    if (view == NULL) {
        return py_fail_from_pending(PyExc_BufferError, lbl, "detach() failed");
    }
    int rc = import_protocol(b, view, lbl, 0, dl, flags);
    Py_DECREF(view);
    return rc;
}

static int
import_protocol(py_batch *b, PyObject *obj, py_label lbl, int may_detach, DLTensor *dl,
                uint64_t *flags)
{
    py_state *st = b->st;
    PyObject *method = PyObject_GetAttr(obj, st->s_dlpack);
    if (method == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return -1;
        }
        PyErr_Clear();
        return py_fail(PyExc_TypeError, lbl,
                       "expected a tensor (an object with __dlpack__), got %.100s",
                       PY_TYPE_NAME(obj));
    }
    long device_type = kDLCPU;
    if (py_dlpack_device_type(st, obj, lbl, &device_type) < 0) {
        Py_DECREF(method);
        return -1;
    }
    PyObject *const *kwargs = st->dlpack_kwargs[device_type == kDLCUDA];
    PyObject *cap = PyObject_Call(method, st->no_args, kwargs[1]);
    if (cap == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear(); /* a producer older than DLPack 1.0 (torch <= 2.8): no max_version */
        cap = PyObject_Call(method, st->no_args, kwargs[0]);
    }
    Py_DECREF(method);
    if (cap == NULL) {
        /* torch refuses tensors that require grad (BufferError; RuntimeError up to torch 2.8):
         * export a detached view of the same memory */
        if (!may_detach || !(PyErr_ExceptionMatches(PyExc_BufferError) ||
                             PyErr_ExceptionMatches(PyExc_RuntimeError))) {
            return py_fail_from_pending(PyExc_BufferError, lbl, "__dlpack__() failed");
        }
        return import_detached(b, obj, lbl, dl, flags);
    }
    int rc = -1;
    if (PyCapsule_CheckExact(cap)) {
        rc = consume_capsule(b, cap, lbl, dl, flags);
    } else {
        py_fail(PyExc_BufferError, lbl, "__dlpack__() returned %.100s, not a capsule",
                PY_TYPE_NAME(cap));
    }
    Py_DECREF(cap); /* renamed: the producer's destructor leaves the tensor to us */
    return rc;
}

/* ---------------------------------------------------------------- entry points ---- */

static int
import_labelled(py_batch *b, PyObject *obj, py_label lbl, unsigned opts, tm_tensor *out,
                py_path *path, size_t *nbytes)
{
    DLTensor dl;
    uint64_t flags = 0;
    py_path how;
    int rc;
    const DLPackExchangeAPI *api;
    if (PyCapsule_CheckExact(obj)) {
        how = PY_PATH_CAPSULE;
        rc = consume_capsule(b, obj, lbl, &dl, &flags);
    } else if ((api = py_exchange_api(b->st, Py_TYPE(obj))) != NULL) {
        how = PY_PATH_EXCHANGE;
        rc = import_exchange(b, api, obj, lbl, &dl, &flags);
    } else {
        how = PY_PATH_PROTOCOL;
        rc = import_protocol(b, obj, lbl, 1, &dl, &flags);
    }
    if (rc < 0) {
        return -1;
    }
    if (path != NULL) {
        *path = how;
    }
    return py_check_dltensor(&dl, flags, lbl, opts, out, nbytes);
}

int
py_import(py_batch *b, PyObject *obj, const char *name, Py_ssize_t index, unsigned opts,
          tm_tensor *out, py_path *path, size_t *nbytes)
{
    return import_labelled(b, obj, (py_label){name, index}, opts, out, path, nbytes);
}

int
py_import_optional(py_batch *b, PyObject *obj, const char *name, tm_tensor *out)
{
    if (obj == Py_None) {
        memset(out, 0, sizeof *out);
        out->device_type = TM_DEVICE_CPU;
        return 0;
    }
    if (import_labelled(b, obj, (py_label){name, -1}, 0, out, NULL, NULL) < 0) {
        return -1;
    }
    if (out->numel == 0) {
        /* the core reads "not given" as no elements (tm_tensor_given): an empty tensor would
         * silently act as None (a skip flag that skips nothing, a coefficient never written) */
        return py_fail(PyExc_ValueError, (py_label){name, -1},
                       "an empty tensor (give None to leave it out)");
    }
    return 0;
}

int
py_import_list(py_batch *b, PyObject *seq, const char *name, int allow_none, tm_tensor_list *out)
{
    out->name = name;
    out->count = 0;
    out->tensors = NULL;
    if (allow_none && seq == Py_None) {
        return 0;
    }
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a list or tuple of tensors, got %.100s", name,
                     PY_TYPE_NAME(seq));
        return -1;
    }
    Py_ssize_t n = py_seq_size(seq);
    if (n > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: too many tensors (%zd)", name, n);
        return -1;
    }
    tm_tensor *t = py_batch_alloc(b, (size_t)n * sizeof *t);
    if (t == NULL || reserve_refs(b, n) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = py_seq_item(seq, i);
        if (item == NULL) { /* IndexError: __dlpack__ may run any Python code */
            PyErr_Format(PyExc_RuntimeError, "%s: the list changed size during the call", name);
            return -1;
        }
        Py_INCREF(item);
        int rc = import_labelled(b, item, (py_label){name, i}, 0, &t[i], NULL, NULL);
        Py_DECREF(item);
        if (rc < 0) {
            return -1;
        }
    }
    out->tensors = t;
    out->count = (int32_t)n;
    return 0;
}
