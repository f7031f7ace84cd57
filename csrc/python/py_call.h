/*
 * py_call.h -- what the wrappers of py_ops.c share (implemented in py_call.c): host arguments,
 * the tm_exec of a call (device, stream, scratch), running it, and mapping its status.
 */
#ifndef TM_PY_CALL_H
#define TM_PY_CALL_H

#include "dlpack_import.h"
#include "py_module.h"
#include "titanmac.h"

typedef struct {
    tm_exec ex;
    void *heap; /* CPU scratch allocated for this call (malloc) */
    int on_cpu;
} py_call;

/* groups: [(beta1, beta2, eps, weight_decay, maximize), ...] -> a->groups, a->num_groups. */
int py_parse_groups(py_batch *b, PyObject *groups, tm_adamw_args *a);

/* None -> NULL; else a list of exactly count ints or bools (one per tensor of the list named
 * `of`), the argument called `name` in messages: group_of, has_prev. */
int py_parse_ints(py_batch *b, PyObject *obj, const char *name, int32_t count, const char *of,
                  const int32_t **out);

/* Fill c for a call on dev's device: threads, stream (CUDA), scratch of at least `need` bytes
 * (the op's *_scratch_bytes, named by sizer in messages). */
int py_setup_call(py_batch *b, const tm_tensor *dev, int num_threads, PyObject *stream,
                  PyObject *scratch, size_t need, const char *sizer, py_call *c);

/* Common exit of a wrapper: release the imports (deleters run here), free scratch; then NULL when
 * the op did not run (!ran: exception already set), the mapped exception when status != TM_OK,
 * else None, counting the call as completed (py_completed_calls). */
PyObject *py_finish(py_batch *b, py_call *c, int ran, tm_status status);

/* Calls this thread completed: ops that returned TM_OK, and callables run by py_run_counted.
 * Python reads it around a call that writes to tell, when an exception (a KeyboardInterrupt)
 * surfaces, whether the call wrote: a signal that arrives during a C call is raised as it
 * returns, after its writes, at the same place as one raised before them. */
unsigned long long py_completed_calls(void);

/* _C.run_counted(fn, *args, **kwargs): fn(*args, **kwargs), counted as completed when it
 * returns (a CUDA graph's replay, which runs no op of ours). */
PyObject *py_run_counted(PyObject *module, PyObject *args, PyObject *kwargs);

/* _C.completed_calls(): py_completed_calls() as an int. */
PyObject *py_completed_calls_object(PyObject *module, PyObject *unused);

/* Set the exception for a failed tm_* call (message: tm_last_error()); returns NULL. */
PyObject *py_raise_status(py_state *st, tm_status status);

/* The device of a call is its first tensor's; the core rejects mixed devices. */
static inline const tm_tensor *
py_first_or(const tm_tensor_list *l, const tm_tensor *fallback)
{
    return l->count > 0 ? &l->tensors[0] : fallback;
}

/* Run expr with the GIL released on the CPU (the loops touch no Python object); on CUDA it only
 * enqueues work, so keep the GIL and skip the thread-state switch. */
#define PY_RUN(c, status, expr)                                                                    \
    do {                                                                                           \
        if ((c).on_cpu) {                                                                          \
            Py_BEGIN_ALLOW_THREADS(status) = (expr);                                               \
            Py_END_ALLOW_THREADS                                                                   \
        } else {                                                                                   \
            (status) = (expr);                                                                     \
        }                                                                                          \
    } while (0)

#endif /* TM_PY_CALL_H */
