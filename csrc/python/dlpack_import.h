/*
 * dlpack_import.h -- Python object -> tm_tensor. Every DLPack ownership rule lives in
 * dlpack_import.c and only there; dlpack_check.c finds a type's exchange table and checks what a
 * DLTensor holds.
 *
 * One py_batch collects everything the tensors of one call keep alive: strong references to the
 * objects read through the exchange table without ownership, the managed tensors taken from
 * capsules (their deleters), and the tm_tensor arrays. py_batch_release() undoes all of it; call it
 * once on every path out of a wrapper, after the op ran, with the GIL held.
 *
 * Up to six lists of 64 tensors per call need no heap allocation (the batch lives on the stack).
 */
#ifndef TM_DLPACK_IMPORT_H
#define TM_DLPACK_IMPORT_H

#include "py_module.h"
#include "titanmac.h"
#include "tm_dlpack.h"

/* bytes: 384 tm_tensor (six lists of 64, 56 bytes each) plus group arrays */
#define PY_BATCH_ARENA 24576
#define PY_BATCH_INLINE_REFS 400
#define PY_BATCH_INLINE_OWNED 16
#define PY_BATCH_MAX_BLOCKS 32 /* cms_step imports up to 20 lists */

/* How a tensor came in (reported by _import for the DLPack tests). */
typedef enum { PY_PATH_EXCHANGE = 0, PY_PATH_PROTOCOL = 1, PY_PATH_CAPSULE = 2 } py_path;

/* py_import() options */
#define PY_IMPORT_ANY_DTYPE 1u /* scratch: any dtype, report its size in bytes */

typedef struct {
    void *managed; /* DLManagedTensor * or DLManagedTensorVersioned * */
    int versioned;
} py_owned;

typedef struct {
    py_state *st;
    const DLPackExchangeAPI *api; /* table of the first tensor read through one (for its stream) */
    PyObject **refs;              /* objects whose DLTensor we borrow (exchange path) */
    Py_ssize_t n_refs, cap_refs;
    py_owned *owned; /* managed tensors whose deleter we must call */
    Py_ssize_t n_owned, cap_owned;
    size_t arena_used;
    void *blocks[PY_BATCH_MAX_BLOCKS]; /* allocations that did not fit the arena */
    int n_blocks;
    PyObject *refs_inline[PY_BATCH_INLINE_REFS];
    py_owned owned_inline[PY_BATCH_INLINE_OWNED];
    _Alignas(16) unsigned char arena[PY_BATCH_ARENA];
} py_batch;

void py_batch_init(py_batch *b, py_state *st);

/* Call the deleters of owned tensors, drop held references, free heap arrays. Idempotent. */
void py_batch_release(py_batch *b);

/* Memory (16-byte aligned) that lives until py_batch_release; NULL with MemoryError set. */
void *py_batch_alloc(py_batch *b, size_t bytes);

/* Import one tensor. name/index label messages ("grads[3]: ..."; index < 0: "lr: ..."). path and
 * nbytes may be NULL. Returns 0, or -1 with BufferError (unusable tensor) or TypeError (not a
 * tensor) set. */
int py_import(py_batch *b, PyObject *obj, const char *name, Py_ssize_t index, unsigned opts,
              tm_tensor *out, py_path *path, size_t *nbytes);

/* None -> the "not wanted" tensor (data NULL, numel 0); anything else as py_import(). */
int py_import_optional(py_batch *b, PyObject *obj, const char *name, tm_tensor *out);

/* A list or tuple of tensors (None counts as empty when allow_none) -> out, storage in the batch.
 * TypeError when seq is neither. */
int py_import_list(py_batch *b, PyObject *seq, const char *name, int allow_none,
                   tm_tensor_list *out);

/* The exchange table objects of this type are read through, or NULL (none, or the intake mode is
 * "protocol"). Cached per type. Never fails. */
const DLPackExchangeAPI *py_exchange_api(py_state *st, PyTypeObject *type);

/* ---------------------------------------------------------------- dlpack_check.c ---- */

/* Names a tensor in messages: "grads[3]", or "lr" when index < 0. */
typedef struct {
    const char *name;
    Py_ssize_t index;
} py_label;

/* Raise type("<label>: <printf message>"); returns -1. */
int py_fail(PyObject *type, py_label lbl, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* The pending exception (normalized, traceback attached; NULL if none), cleared; and back. */
PyObject *py_take_exception(void);
void py_restore_exception(PyObject *exc); /* steals exc; NULL: nothing */

/* Raise type("<label>: <what>: <message of the pending exception>") chained from it (the
 * producer's own words reach the user); non-Exception errors pass unchanged. Returns -1. */
int py_fail_from_pending(PyObject *type, py_label lbl, const char *what);

/* A DLTensor with its DLPack flags -> tm_tensor (BufferError when unusable). PY_IMPORT_ANY_DTYPE
 * accepts any dtype; nbytes (may be NULL) gets numel * itemsize. */
int py_check_dltensor(const DLTensor *dl, uint64_t flags, py_label lbl, unsigned opts,
                      tm_tensor *out, size_t *nbytes);

/* DLPack device type from obj.__dlpack_device__() (kDLCPU when the producer has none); -1 with
 * BufferError set when it fails or answers something else. */
int py_dlpack_device_type(py_state *st, PyObject *obj, py_label lbl, long *type);

#endif /* TM_DLPACK_IMPORT_H */
