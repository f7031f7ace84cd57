/*
 * cuda_ops.h -- the CUDA backend's entry points, callable from C (core/tm_dispatch.c).
 *
 * Each cuda_<op> has the signature of its tm_<op> in titanmac.h and is called only after
 * tm_dispatch.c has validated every argument (counts, numels, dtypes, one CUDA device, writability,
 * hyperparameters), so it checks only what the CUDA side alone can know (launch errors).
 * Tensors with numel == 0 may appear in the lists; the kernels must skip their elements but still
 * honour their step counts.
 */
#ifndef TM_CUDA_OPS_H
#define TM_CUDA_OPS_H

#include "titanmac.h"

#ifdef __cplusplus
extern "C" {
#endif

size_t cuda_norms_scratch_bytes(const tm_tensor_list *grads, const tm_tensor_list *params);
tm_status cuda_norms(const tm_tensor_list *grads, const tm_tensor_list *params,
                     const tm_norms_args *args, const tm_norms_out *out, const tm_exec *exec);
tm_status cuda_clip_coef(const tm_tensor *total_norm, double max_norm, const tm_tensor *coef,
                         const tm_exec *exec);
tm_status cuda_scale(const tm_tensor_list *tensors, const tm_tensor *scale, const tm_exec *exec);
size_t cuda_adamw_scratch_bytes(const tm_adamw_tensors *t);
tm_status cuda_adamw_step(const tm_adamw_tensors *t, const tm_adamw_args *args,
                          const tm_adamw_inputs *in, const tm_exec *exec);
size_t cuda_cms_scratch_bytes(const tm_tensor_list *params, int32_t levels, tm_cms_net net);
tm_status cuda_cms_step(const tm_cms_tensors *t, const tm_cms_args *args, const tm_cms_inputs *in,
                        const tm_exec *exec);
size_t cuda_cms_surrogate_scratch_bytes(const tm_tensor_list *targets, int32_t layers);
tm_status cuda_cms_surrogate(const tm_cms_surrogate_tensors *t, const tm_cms_surrogate_args *args,
                             const tm_cms_surrogate_inputs *in, const tm_exec *exec);
tm_status cuda_dno_control(const tm_dno_control_tensors *t, const tm_dno_control_args *args,
                           const tm_exec *exec);

#ifdef __cplusplus
}
#endif

#endif /* TM_CUDA_OPS_H */
