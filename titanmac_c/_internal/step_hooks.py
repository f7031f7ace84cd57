"""torch's optimizer step bookkeeping for an update that does not go through Optimizer.step (the
DeepNestedOptimizer's update by its base AdamW): the step hooks, run in the order torch's step
wrapper runs them, and the flag its LR schedulers read."""

from torch.optim import optimizer as torch_optimizer


def has_step_hooks(optimizer):
    """Whether torch's step wrapper would run a hook around optimizer.step() (one of its own or
    a global one)."""
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or torch_optimizer._global_optimizer_pre_hooks
                or torch_optimizer._global_optimizer_post_hooks)


def with_step_hooks(optimizer, step):
    """step() run between the hooks as torch's Optimizer.step wrapper runs them (global
    pre-hooks, own pre-hooks, the step, own post-hooks, global post-hooks; a pre-hook may
    replace the arguments the post-hooks see)."""
    args, kwargs = (optimizer,), {}
    for hook in (*torch_optimizer._global_optimizer_pre_hooks.values(),
                 *optimizer._optimizer_step_pre_hooks.values()):
        result = hook(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"{hook} must return None or a tuple of (new_args, "
                                   f"new_kwargs), but got {result}.")
            args, kwargs = result
    step()
    for hook in (*optimizer._optimizer_step_post_hooks.values(),
                 *torch_optimizer._global_optimizer_post_hooks.values()):
        hook(optimizer, args, kwargs)


def tell_schedulers_stepped(optimizer):
    """What torch's Optimizer.step wrapper records for the LR schedulers attached to optimizer
    (its "lr_scheduler.step() before optimizer.step()" warning reads it), for a step that
    updated optimizer's parameters without going through its step()."""
    optimizer._opt_called = True
