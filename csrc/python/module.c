/*
 * module.c -- titanmac_c._C: multi-phase initialisation (PEP 489, as CPython's xxlimited.c), the
 * module state (titanmac_c.Error, the per-type cache of DLPack exchange tables, the intake mode,
 * interned names) and the method table. The wrappers live in py_ops.c, the importer in
 * dlpack_import.c.
 *
 * Environment, read once when the module executes:
 *   TITANMAC_CPU_ISA  generic | avx2 | avx512 (unset or empty: the best this CPU supports)
 *   TITANMAC_DLPACK   protocol: always use __dlpack__ (anything else: the exchange table when the
 *                     tensor's type offers one)
 */
#include "py_call.h"
#include "py_module.h"

#include <stdlib.h>
#include <string.h>

static PyObject *
py_cpu_isa(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyUnicode_FromString(tm_cpu_isa());
}

static PyObject *
py_cuda_compiled(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyBool_FromLong(tm_cuda_compiled());
}

static PyObject *
py_openmp_compiled(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
#ifdef _OPENMP /* every C file is compiled with the same -fopenmp or none */
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

#define KW(fn) (PyCFunction)(void (*)(void))(fn), METH_VARARGS | METH_KEYWORDS

static PyMethodDef module_methods[] = {
    {"adamw_step", KW(py_adamw_step),
     "adamw_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, groups, "
     "group_of=None, *, amsgrad=False, grad_scale=None, skip=None, zero_grads_on_skip=False, "
     "loss_scale=None, num_threads=1, stream=None, scratch=None)\n--\n\n"
     "One AdamW step over lists of tensors (tm_adamw_step)."},
    {"adamw_scratch_bytes", KW(py_adamw_scratch_bytes),
     "adamw_scratch_bytes(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)\n--\n\n"
     "Bytes of scratch adamw_step needs for these tensors."},
    {"norms", KW(py_norms),
     "norms(grads, params, group_grad, total_grad, *, group_param=None, total_param=None, "
     "nonfinite=None, group_of=None, num_groups=1, norm_type=2.0, num_threads=1, stream=None, "
     "scratch=None, coef=None, max_norm=0.0, result_dtype=None)\n--\n\n"
     "Per-group and global p-norms of grads (and params) (tm_norms); with coef, the clip "
     "coefficient of total_grad rounded to result_dtype ('float16', 'bfloat16'; None: as "
     "stored)."},
    {"norms_scratch_bytes", KW(py_norms_scratch_bytes),
     "norms_scratch_bytes(grads, params=None)\n--\n\nBytes of scratch norms needs."},
    {"clip_coef", KW(py_clip_coef),
     "clip_coef(total_norm, max_norm, coef, *, stream=None)\n--\n\n"
     "coef = min(1, max_norm / (total_norm + 1e-6)) on the tensors' device (total_norm of any "
     "floating dtype: the norm as returned)."},
    {"scale_", KW(py_scale),
     "scale_(tensors, scale, *, num_threads=1, stream=None)\n--\n\nt *= scale[0] for each t."},
    {"dno_control", KW(py_dno_control),
     "dno_control(group_grad, group_param, total_grad, depths, loss, weights, mu, ema, lr, coef, "
     "skip, *, hidden, layers, update_controller, first_step, check_loss, base_lr, "
     "max_grad_norm, ema_beta=0.1, mu_min=0.1, mu_max=2.0, stream=None, previous=None)\n--\n\n"
     "One DeepNestedOptimizer control step on the tensors' device (tm_dno_control); previous "
     "[2G + 4], when given, receives mu, ema, lr, coef and skip as they were before it."},
    {"cms_step", KW(py_cms_step),
     "cms_step(params, grads, momentum, accumulated, ema, v_sq, step_counts, lr, group_of, "
     "weights, *, fires, divisors, ema_decays, net, hidden, layers, weight_decay, t, base_lr, "
     "loss, grad_scale=None, skip=None, context=None, beta2=0.999, momentum_coef=0.9, "
     "clamp_ratio=100.0, num_threads=1, stream=None, scratch=None, check_only=False)\n--\n\n"
     "Phase 2 of the DeepNestedOptimizer's CMS step over lists of tensors (tm_cms_step); "
     "context: float64 [2] (t, base_lr) read in memory instead of t and base_lr (CUDA graphs); "
     "check_only: its checks alone (tm_cms_check), nothing written."},
    {"cms_scratch_bytes", KW(py_cms_scratch_bytes),
     "cms_scratch_bytes(params, *, levels, net)\n--\n\nBytes of scratch cms_step needs."},
    {"cms_surrogate", KW(py_cms_surrogate),
     "cms_surrogate(targets, momentum, outputs, weights, weight_grads, losses, *, divisor, hidden, "
     "layers, has_prev=None, scale=None, num_threads=1, stream=None, scratch=None)\n--\n\n"
     "Phase 1 of the DeepNestedOptimizer's CMS step, the DirectUpdateMLP's surrogate loss "
     "gradient (tm_cms_surrogate; CPU and CUDA)."},
    {"cms_surrogate_scratch_bytes", KW(py_cms_surrogate_scratch_bytes),
     "cms_surrogate_scratch_bytes(targets, *, layers)\n--\n\nBytes of scratch cms_surrogate "
     "needs."},
    {"cpu_isa", py_cpu_isa, METH_NOARGS,
     "cpu_isa()\n--\n\nThe CPU instruction set in use: generic, avx2 or avx512."},
    {"_select_cpu_isa", KW(py_select_cpu_isa),
     "_select_cpu_isa(name)\n--\n\nUse another CPU instruction set (None: the best)."},
    {"cuda_compiled", py_cuda_compiled, METH_NOARGS,
     "cuda_compiled()\n--\n\nTrue when this build has the CUDA backend."},
    {"openmp_compiled", py_openmp_compiled, METH_NOARGS,
     "openmp_compiled()\n--\n\nTrue when the CPU loops were built with OpenMP (else they run on "
     "one thread)."},
    {"dlpack_intake", KW(py_dlpack_intake),
     "dlpack_intake(obj=None)\n--\n\nThe intake mode ('exchange' or 'protocol'), or the path obj "
     "would take ('exchange', 'protocol' or 'capsule')."},
    {"completed_calls", py_completed_calls_object, METH_NOARGS,
     "completed_calls()\n--\n\nCalls this thread completed (ops that ran to TM_OK, callables "
     "run by run_counted): read around a call to tell whether it wrote."},
    {"run_counted", KW(py_run_counted),
     "run_counted(fn, *args, **kwargs)\n--\n\nfn(*args, **kwargs), counted by completed_calls "
     "when it returns."},
    {"_import", KW(py_import_info),
     "_import(obj, name='tensor')\n--\n\nImport obj as the ops do; describe the result (tests)."},
    {NULL, NULL, 0, NULL}};

static int
add_ref(PyObject *module, const char *name, PyObject *value)
{
    Py_INCREF(value);
    if (PyModule_AddObject(module, name, value) < 0) {
        Py_DECREF(value);
        return -1;
    }
    return 0;
}

static int
module_exec(PyObject *module)
{
    py_state *st = py_get_state(module);
    const char *isa = getenv("TITANMAC_CPU_ISA");
    if (tm_cpu_select_isa(isa) != TM_OK) {
        PyErr_Format(PyExc_ValueError, "TITANMAC_CPU_ISA=%s: %s", isa ? isa : "",
                     tm_last_error());
        return -1;
    }
    const char *intake = getenv("TITANMAC_DLPACK");
    st->intake_protocol = intake != NULL && strcmp(intake, "protocol") == 0;
    st->error = PyErr_NewExceptionWithDoc(
        "titanmac_c.Error",
        "A failure inside titanmac_c: a CUDA error, an operation this build cannot run, or a bug.",
        PyExc_RuntimeError, NULL);
    if (st->error == NULL || add_ref(module, "Error", st->error) < 0) {
        return -1;
    }
    st->s_dlpack = PyUnicode_InternFromString("__dlpack__");
    st->s_dlpack_device = PyUnicode_InternFromString("__dlpack_device__");
    st->s_detach = PyUnicode_InternFromString("detach");
    st->s_exchange_api = PyUnicode_InternFromString("__dlpack_c_exchange_api__");
    st->s_exchange_legacy = PyUnicode_InternFromString("__c_dlpack_exchange_api__");
    st->no_args = PyTuple_New(0);
    if (st->s_dlpack == NULL || st->s_dlpack_device == NULL || st->s_detach == NULL ||
        st->s_exchange_api == NULL || st->s_exchange_legacy == NULL || st->no_args == NULL) {
        return -1;
    }
    /* -1: no sync by the producer; we launch on torch's current stream (dlpack.md section 5) */
    PyObject **kw = &st->dlpack_kwargs[0][0];
    kw[0] = Py_BuildValue("{s:O}", "stream", Py_None);
    kw[1] = Py_BuildValue("{s:O,s:(ii)}", "stream", Py_None, "max_version", TM_DLPACK_MAJOR,
                          TM_DLPACK_MINOR);
    kw[2] = Py_BuildValue("{s:i}", "stream", -1);
    kw[3] = Py_BuildValue("{s:i,s:(ii)}", "stream", -1, "max_version", TM_DLPACK_MAJOR,
                          TM_DLPACK_MINOR);
    if (kw[0] == NULL || kw[1] == NULL || kw[2] == NULL || kw[3] == NULL) {
        return -1;
    }
    /* The sizes the C core's fixed arrays take (stack, shared memory, kernel parameters), so
     * the DeepNestedOptimizer refuses a larger configuration when it is built, not at its first
     * step. */
    if (PyModule_AddIntConstant(module, "CMS_MAX_LEVELS", TM_CMS_MAX_LEVELS) < 0 ||
        PyModule_AddIntConstant(module, "CMS_MAX_LAYERS", TM_CMS_MAX_LAYERS) < 0 ||
        PyModule_AddIntConstant(module, "CMS_LEGACY_MAX_HIDDEN", TM_CMS_LEGACY_MAX_HIDDEN) < 0 ||
        PyModule_AddIntConstant(module, "DNO_MAX_HIDDEN", TM_DNO_MAX_HIDDEN) < 0 ||
        PyModule_AddIntConstant(module, "DNO_MAX_LAYERS", TM_DNO_MAX_LAYERS) < 0) {
        return -1;
    }
    return 0;
}

static int
module_traverse(PyObject *module, visitproc visit, void *arg)
{
    py_state *st = py_get_state(module);
    if (st == NULL) {
        return 0;
    }
    Py_VISIT(st->error);
    for (int i = 0; i < st->n_api; i++) {
        Py_VISIT(st->api_cache[i].type);
        Py_VISIT(st->api_cache[i].owner);
    }
    return 0;
}

static int
module_clear(PyObject *module)
{
    py_state *st = py_get_state(module);
    if (st == NULL) {
        return 0;
    }
    Py_CLEAR(st->error);
    for (int i = 0; i < st->n_api; i++) {
        Py_CLEAR(st->api_cache[i].type);
        Py_CLEAR(st->api_cache[i].owner);
    }
    st->n_api = 0;
    Py_CLEAR(st->s_dlpack);
    Py_CLEAR(st->s_dlpack_device);
    Py_CLEAR(st->s_detach);
    Py_CLEAR(st->s_exchange_api);
    Py_CLEAR(st->s_exchange_legacy);
    Py_CLEAR(st->no_args);
    for (int i = 0; i < 4; i++) {
        Py_CLEAR((&st->dlpack_kwargs[0][0])[i]);
    }
    return 0;
}

static void
module_free(void *module)
{
    module_clear((PyObject *)module);
}

static PyModuleDef_Slot module_slots[] = {{Py_mod_exec, (void *)module_exec}, {0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "titanmac_c._C",
    .m_doc = "titanmac_c._C: fused optimizer-step kernels over lists of DLPack tensors.",
    .m_size = sizeof(py_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__C(void)
{
    return PyModuleDef_Init(&module_def);
}
