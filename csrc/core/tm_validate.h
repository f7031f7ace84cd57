/*
 * tm_validate.h -- the argument checks of every public op, run before anything is written so a
 * failing call changes no tensor (numpy's dlpack.c and torch's optimizer constructors check
 * everything up front in the same way).
 *
 * Each tm_validate_<op> checks, in this order: the structure (NULL pointers, list counts), each
 * tensor alone (numel, data, dtype, device type), one device for all, numel and dtype per index
 * against the lead list, writability, aliasing, then the op's own shapes, hyperparameters and
 * scratch. On success *ref is the tensor whose device the call runs on (first of the lead list,
 * or the first lone tensor given when the lead list is empty) and ref_label its name.
 */
#ifndef TM_VALIDATE_H
#define TM_VALIDATE_H

#include "titanmac.h"
#include "tm_roles.h"

tm_status tm_validate_norms(const tm_tensor_list *grads, const tm_tensor_list *params,
                            const tm_norms_args *args, const tm_norms_out *out, const tm_exec *exec,
                            tm_device_ref *ref);
tm_status tm_validate_clip(const tm_tensor *total_norm, double max_norm, const tm_tensor *coef,
                           const tm_exec *exec, tm_device_ref *ref);
tm_status tm_validate_scale(const tm_tensor_list *tensors, const tm_tensor *scale,
                            const tm_exec *exec, tm_device_ref *ref);
tm_status tm_validate_adamw(const tm_adamw_tensors *t, const tm_adamw_args *args,
                            const tm_adamw_inputs *in, const tm_exec *exec, tm_device_ref *ref);
tm_status tm_validate_cms(const tm_cms_tensors *t, const tm_cms_args *args, const tm_cms_inputs *in,
                          const tm_exec *exec, tm_device_ref *ref);
tm_status tm_validate_cms_surrogate(const tm_cms_surrogate_tensors *t,
                                    const tm_cms_surrogate_args *args,
                                    const tm_cms_surrogate_inputs *in, const tm_exec *exec,
                                    tm_device_ref *ref);
tm_status tm_validate_dno_control(const tm_dno_control_tensors *t, const tm_dno_control_args *args,
                                  const tm_exec *exec, tm_device_ref *ref);

#endif /* TM_VALIDATE_H */
