"""differentiable=True: the groups that ask for it are stepped by torch's own differentiable AdamW
(torch.optim.adam.adam with differentiable=True and decoupled weight decay, the single-tensor
path torch.optim.AdamW runs for them), so autograd records the update as it records torch's. The C
core writes through DLPack, which autograd cannot see, so it does not run for these groups.

The state is ours (init_state: "step" a float32 tensor on the parameter's device, the moments in
its layout); torch's functional takes either placement of "step"."""

import torch
from torch.optim.adam import adam as torch_adam

from .state import init_state

# torch's list of devices with fused kernels (torch.utils._foreach_utils), in its words below
_FUSED_DEVICES = ("mps", "cuda", "xpu", "hpu", "cpu", "mtia",
                  torch._C._get_privateuse1_backend_name())


def check_fused_supported(p):
    """torch's check for a parameter of a fused=True group, made when its state is created:
    RuntimeError for a parameter that is not floating point or on a device without fused
    kernels (a complex or meta parameter), in torch's words."""
    if not (p.device.type in _FUSED_DEVICES and torch.is_floating_point(p)):
        raise RuntimeError(
            "`fused=True` requires all the params to be floating point Tensors of supported "
            f"devices: {list(_FUSED_DEVICES)} but {p.dtype} and {p.device.type}")


def is_differentiable(group):
    return bool(group.get("differentiable", False))


def differentiable_group_step(optimizer, group):
    """One step of the parameters of `group` (a differentiable=True group of a titanmac_c.AdamW)
    that have gradients, as torch.optim.AdamW steps such a group. Runs with grad mode on, as
    torch's step runs for a differentiable optimizer."""
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
    has_complex = False
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError("AdamW does not support sparse gradients")
        state = optimizer.state[p]
        if len(state) == 0:
            state.update(init_state(p, group["amsgrad"]))
        if state["step"].requires_grad:
            raise RuntimeError("`requires_grad` is not supported for `step` in differentiable "
                               "mode")
        has_complex |= torch.is_complex(p)
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        if group["amsgrad"]:
            max_exp_avg_sqs.append(state["max_exp_avg_sq"])
        steps.append(state["step"])
    if not params:
        return
    beta1, beta2 = group["betas"]
    with torch.enable_grad():
        torch_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                   foreach=False, capturable=group["capturable"], differentiable=True,
                   fused=False, has_complex=has_complex, decoupled_weight_decay=True,
                   amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                   weight_decay=group["weight_decay"], eps=group["eps"],
                   maximize=group["maximize"])
