/*
 * py_module.h -- what the binding files share: the module state (the titanmac_c.Error type,
 * the per-type cache of DLPack exchange tables, the intake mode, interned names) and the
 * prototypes of the wrappers in py_ops.c that module.c puts in its method table.
 *
 * The state lives in the module object (multi-phase init, PEP 489), not in C globals; the wrappers
 * reach it through their `module` argument.
 */
#ifndef TM_PY_MODULE_H
#define TM_PY_MODULE_H

/* The Limited API of Python 3.10 (PEP 384): the one built extension (a cp310-abi3 wheel) loads
 * in every CPython >= 3.10. What it lacks is written out here: no tp_name (py_type_name), no
 * vectorcall (the protocol path's keyword dicts), no PyErr_GetRaisedException (Fetch/Restore),
 * PyTuple/PyList item access through functions, not macros. */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "titanmac.h"
#include "tm_dlpack.h"

/* Types seen by the importer (torch.Tensor, nn.Parameter, numpy.ndarray, ...). A full cache only
 * means further types are looked up on every call, never a wrong answer. A type without a table
 * is remembered only when it is a static type: a class defined at run time (a wrapper made per
 * call or per test) would otherwise be kept alive, with all it holds, for the process's life. */
#define PY_API_CACHE_SIZE 16

typedef struct {
    PyTypeObject *type;           /* strong reference */
    const DLPackExchangeAPI *api; /* NULL: the type offers no usable table */
    PyObject *owner;              /* the attribute that gave api (strong: a capsule owning the
                                     table keeps it valid if the attribute is replaced), or NULL */
} py_api_entry;

typedef struct {
    PyObject *error;     /* titanmac_c.Error, a subclass of RuntimeError */
    int intake_protocol; /* TITANMAC_DLPACK=protocol: never use the exchange table */
    int n_api;
    py_api_entry api_cache[PY_API_CACHE_SIZE];
    /* interned names and constant argument tuples of the Python-protocol path */
    PyObject *s_dlpack;          /* "__dlpack__" */
    PyObject *s_dlpack_device;   /* "__dlpack_device__" */
    PyObject *s_detach;          /* "detach" */
    PyObject *s_exchange_api;    /* "__dlpack_c_exchange_api__" (DLPack 1.3, a capsule) */
    PyObject *s_exchange_legacy; /* "__c_dlpack_exchange_api__" (DLPack 1.2, int or capsule) */
    PyObject *no_args;           /* () */
    /* __dlpack__'s keywords: [cuda][with max_version]: {"stream": -1 on CUDA ("the producer
     * must not synchronize") else None, "max_version": (TM_DLPACK_MAJOR, TM_DLPACK_MINOR)};
     * a callee gets its own copy of a keyword dict, so these are shared by every call */
    PyObject *dlpack_kwargs[2][2];
} py_state;

static inline py_state *
py_get_state(PyObject *module)
{
    return (py_state *)PyModule_GetState(module);
}

/* A list's or tuple's size and (borrowed) item, for a caller that checked it is one: what
 * PySequence_Fast_GET_SIZE and _ITEM read, through the Limited API's functions. */
static inline Py_ssize_t
py_seq_size(PyObject *seq)
{
    return PyList_Check(seq) ? PyList_Size(seq) : PyTuple_Size(seq);
}

static inline PyObject *
py_seq_item(PyObject *seq, Py_ssize_t i)
{
    return PyList_Check(seq) ? PyList_GetItem(seq, i) : PyTuple_GetItem(seq, i);
}

/* The name of obj's type for a message, as its tp_name reads (which the Limited API hides):
 * "list", "MyTensor", "torch.dtype"; cut to fit buf, "?" when it has none. Leaves a pending
 * exception as it was. */
#define PY_TYPE_NAME_MAX 101
const char *py_type_name(PyObject *obj, char buf[PY_TYPE_NAME_MAX]);
/* ... with a buffer that lives as long as the enclosing block (a message's arguments) */
#define PY_TYPE_NAME(obj) py_type_name((obj), (char[PY_TYPE_NAME_MAX]){0})

/* py_ops.c, py_cms.c: one wrapper per C API function (METH_VARARGS | METH_KEYWORDS). */
PyObject *py_adamw_step(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_adamw_scratch_bytes(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_norms(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_norms_scratch_bytes(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_clip_coef(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_scale(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_cms_step(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_cms_scratch_bytes(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_cms_surrogate(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_cms_surrogate_scratch_bytes(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_dno_control(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_select_cpu_isa(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_dlpack_intake(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_import_info(PyObject *module, PyObject *args, PyObject *kwargs);

#endif /* TM_PY_MODULE_H */
