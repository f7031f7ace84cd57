/*
 * tm_dispatch.c -- the public functions of titanmac.h: clear the last error, validate every
 * argument (tm_validate.c) before anything is written, then run the op on the backend of the
 * tensors' device: cpu_<op> (cpu/) or cuda_<op> (cuda/), as TransformerEngine's common/ API
 * routes to its kernels.
 *
 * With tm_scratch.c (the *_scratch_bytes functions) this is the only place outside cuda/ that
 * knows whether CUDA was compiled in (TM_WITH_CUDA); without it a call on CUDA tensors passes
 * validation and then fails with TM_ERR_UNSUPPORTED.
 */
#include "../common/tm_status.h"
#include "../cpu/cpu_ops.h"
#include "tm_validate.h"

#ifdef TM_WITH_CUDA
#include "../cuda/cuda_ops.h"
#define TM_CUDA_COMPILED 1
#define TM_ON_CUDA(call, ref) (call)
#else
#define TM_CUDA_COMPILED 0
#define TM_ON_CUDA(call, ref) no_cuda(ref)

static tm_status
no_cuda(const tm_device_ref *ref)
{
    char dev[TM_DEVICE_TEXT];
    return tm_set_error(TM_ERR_UNSUPPORTED, __FILE__, __LINE__,
                        "%s: on %s but this titanmac_c was built without CUDA", ref->label,
                        tm_device_text(ref->tensor, dev));
}
#endif

static int
on_cuda(const tm_device_ref *ref)
{
    return ref->tensor != NULL && ref->tensor->device_type == TM_DEVICE_CUDA;
}

tm_status
tm_norms(const tm_tensor_list *grads, const tm_tensor_list *params, const tm_norms_args *args,
         const tm_norms_out *out, const tm_exec *exec)
{
    tm_device_ref ref;
    tm_clear_error();
    TM_TRY(tm_validate_norms(grads, params, args, out, exec, &ref));
    if (on_cuda(&ref)) {
        return TM_ON_CUDA(cuda_norms(grads, params, args, out, exec), &ref);
    }
    return cpu_norms(grads, params, args, out, exec);
}

tm_status
tm_clip_coef(const tm_tensor *total_norm, double max_norm, const tm_tensor *coef,
             const tm_exec *exec)
{
    tm_device_ref ref;
    tm_clear_error();
    TM_TRY(tm_validate_clip(total_norm, max_norm, coef, exec, &ref));
    if (on_cuda(&ref)) {
        return TM_ON_CUDA(cuda_clip_coef(total_norm, max_norm, coef, exec), &ref);
    }
    return cpu_clip_coef(total_norm, max_norm, coef, exec);
}

tm_status
tm_scale(const tm_tensor_list *tensors, const tm_tensor *scale, const tm_exec *exec)
{
    tm_device_ref ref;
    tm_clear_error();
    TM_TRY(tm_validate_scale(tensors, scale, exec, &ref));
    if (on_cuda(&ref)) {
        return TM_ON_CUDA(cuda_scale(tensors, scale, exec), &ref);
    }
    return cpu_scale(tensors, scale, exec);
}

tm_status
tm_adamw_step(const tm_adamw_tensors *t, const tm_adamw_args *args, const tm_adamw_inputs *in,
              const tm_exec *exec)
{
    tm_device_ref ref;
    tm_clear_error();
    TM_TRY(tm_validate_adamw(t, args, in, exec, &ref));
    if (on_cuda(&ref)) {
        return TM_ON_CUDA(cuda_adamw_step(t, args, in, exec), &ref);
    }
    return cpu_adamw_step(t, args, in, exec);
}

tm_status
tm_cms_step(const tm_cms_tensors *t, const tm_cms_args *args, const tm_cms_inputs *in,
            const tm_exec *exec)
{
    tm_device_ref ref;
    tm_clear_error();
    TM_TRY(tm_validate_cms(t, args, in, exec, &ref));
    if (on_cuda(&ref)) {
        return TM_ON_CUDA(cuda_cms_step(t, args, in, exec), &ref);
    }
    return cpu_cms_step(t, args, in, exec);
}

tm_status
tm_cms_check(const tm_cms_tensors *t, const tm_cms_args *args, const tm_cms_inputs *in,
             const tm_exec *exec)
{
    tm_device_ref ref;
    tm_clear_error();
    return tm_validate_cms(t, args, in, exec, &ref);
}

tm_status
tm_cms_surrogate(const tm_cms_surrogate_tensors *t, const tm_cms_surrogate_args *args,
                 const tm_cms_surrogate_inputs *in, const tm_exec *exec)
{
    tm_device_ref ref;
    tm_clear_error();
    TM_TRY(tm_validate_cms_surrogate(t, args, in, exec, &ref));
    if (on_cuda(&ref)) {
        return TM_ON_CUDA(cuda_cms_surrogate(t, args, in, exec), &ref);
    }
    return cpu_cms_surrogate(t, args, in, exec);
}

tm_status
tm_dno_control(const tm_dno_control_tensors *t, const tm_dno_control_args *args,
               const tm_exec *exec)
{
    tm_device_ref ref;
    tm_clear_error();
    TM_TRY(tm_validate_dno_control(t, args, exec, &ref));
    if (on_cuda(&ref)) {
        return TM_ON_CUDA(cuda_dno_control(t, args, exec), &ref);
    }
    return cpu_dno_control(t, args, exec);
}

tm_status
tm_cpu_select_isa(const char *name)
{
    tm_clear_error();
    return cpu_select_isa(name);
}

const char *
tm_cpu_isa(void)
{
    return cpu_active_kernels()->name;
}

int
tm_cuda_compiled(void)
{
    return TM_CUDA_COMPILED;
}
