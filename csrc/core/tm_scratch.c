/*
 * tm_scratch.c -- the public *_scratch_bytes functions: the scratch each op needs on the backend
 * of the tensors' device, as cpu/ or cuda/ sizes it.
 *
 * Validation (tm_validate*.c) checks the scratch a call was given against these sizes, and
 * dispatch (tm_dispatch.c) runs validation, so the sizes have a unit of their own below both:
 * calls inside core/ run one way, dispatch -> validation -> sizes.
 *
 * A caller sizes scratch before anything is validated, so only the device of the lead list's
 * first tensor is read (a NULL or empty list is sized for the CPU). Without TM_WITH_CUDA a CUDA
 * list needs no scratch: the op itself then fails with TM_ERR_UNSUPPORTED (tm_dispatch.c).
 */
#include "../cpu/cpu_ops.h"
#include "titanmac.h"

#ifdef TM_WITH_CUDA
#include "../cuda/cuda_ops.h"
#define TM_CUDA_BYTES(call) (call)
#else
#define TM_CUDA_BYTES(call) ((size_t)0)
#endif

static int
list_on_cuda(const tm_tensor_list *list)
{
    return list != NULL && list->count > 0 && list->tensors != NULL &&
           list->tensors[0].device_type == TM_DEVICE_CUDA;
}

size_t
tm_norms_scratch_bytes(const tm_tensor_list *grads, const tm_tensor_list *params)
{
    if (list_on_cuda(grads)) {
        return TM_CUDA_BYTES(cuda_norms_scratch_bytes(grads, params));
    }
    return cpu_norms_scratch_bytes(grads, params);
}

size_t
tm_adamw_scratch_bytes(const tm_adamw_tensors *t)
{
    if (t != NULL && list_on_cuda(&t->params)) {
        return TM_CUDA_BYTES(cuda_adamw_scratch_bytes(t));
    }
    return 0; /* the CPU loop needs no scratch */
}

size_t
tm_cms_scratch_bytes(const tm_tensor_list *params, int32_t levels, tm_cms_net net)
{
    if (list_on_cuda(params)) {
        return TM_CUDA_BYTES(cuda_cms_scratch_bytes(params, levels, net));
    }
    return cpu_cms_scratch_bytes(params, levels, net);
}

size_t
tm_cms_surrogate_scratch_bytes(const tm_tensor_list *targets, int32_t layers)
{
    if (list_on_cuda(targets)) {
        return TM_CUDA_BYTES(cuda_cms_surrogate_scratch_bytes(targets, layers));
    }
    return cpu_cms_surrogate_scratch_bytes(targets, layers);
}
