"""AdamW against torch's fused AdamW over seeded random sequences of what training code does to an
optimizer between steps: new gradients, some set to None, clips (ours folded or functional),
steps, zero_grad both ways, a checkpoint loaded into the same or a new optimizer, hyperparameter
edits, add_param_group, a parameter removed from its group, `p.data` swapped, parameters edited
in place, state entries replaced or deleted. Ours caches a plan of the step between calls, so
each of these must reach the next step as it reaches torch's. Parameters and state are compared
after every operation.

The folded clip serves one step (docs/adamw.md): a sequence steps at most once after a clip until
new gradients come."""

import io
import random

import pytest
import torch

import titanmac_c

OPERATIONS = ("grads", "grads", "grads", "step", "step", "step", "clip", "zero", "load", "hyper",
              "add_group", "swap_data", "edit_param", "drop_state", "swap_state", "pop", "no_grad")


class _Pair:
    """Torch's optimizer and ours over parameters with equal values, changed alike."""

    def __init__(self, rng, gen):
        shapes = [rng.choice([(3,), (5, 7), (17,), (2, 3, 2, 2), ()])
                  for _ in range(rng.randint(1, 6))]
        values = [torch.randn(s, generator=gen) for s in shapes]
        self.params = {k: [torch.nn.Parameter(v.clone()) for v in values] for k in "to"}
        kw = dict(lr=rng.choice([1e-2, 0.1]), weight_decay=rng.choice([0.0, 0.1]),
                  amsgrad=rng.random() < 0.3)
        cut = rng.randint(0, len(values))

        def groups(ps):
            return [g for g in ({"params": ps[:cut]}, {"params": ps[cut:], "lr": 0.05})
                    if g["params"]]

        self.opts = {"t": torch.optim.AdamW(groups(self.params["t"]), **kw, fused=True),
                     "o": titanmac_c.AdamW(groups(self.params["o"]), **kw)}
        self.folded = rng.random() < 0.5

    def both(self):
        return (("t", self.params["t"], self.opts["t"]), ("o", self.params["o"], self.opts["o"]))

    def clip(self, max_norm):
        grouped = {k: [p for g in opt.param_groups for p in g["params"]] for k, _, opt in
                   self.both()}
        if all(p.grad is None for p in grouped["t"]):
            return False
        torch.nn.utils.clip_grad_norm_(grouped["t"], max_norm)
        if self.folded:
            self.opts["o"].clip_grad_norm_(max_norm)
        else:
            titanmac_c.clip_grad_norm_(grouped["o"], max_norm)
        return True

    def load(self, fresh):
        for k, _, opt in self.both():
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            if fresh:
                groups = [dict(g) for g in opt.param_groups]
                opt = (torch.optim.AdamW(groups, fused=True) if k == "t"
                       else titanmac_c.AdamW(groups))
                self.opts[k] = opt
            opt.load_state_dict(saved)

    def assert_equal(self, ops):
        for i, (a, b) in enumerate(zip(self.params["t"], self.params["o"])):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"after {ops}, param {i}: {m}")
            state_t, state_o = self.opts["t"].state.get(a, {}), self.opts["o"].state.get(b, {})
            assert set(state_o) == set(state_t), ops
            for key in state_t:
                torch.testing.assert_close(state_o[key].double(), state_t[key].double(),
                                           rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"after {ops}, {key} {i}: {m}")


def _apply(pair, op, rng, gen):
    """Does op to both optimizers alike; False when it does not apply now."""
    params, opts = pair.params, pair.opts
    if op == "grads":
        grads = [torch.randn(p.shape, generator=gen) for p in params["t"]]
        for k in "to":
            for p, g in zip(params[k], grads):
                p.grad = g.clone()
    elif op == "step":
        opts["t"].step()
        opts["o"].step()
    elif op == "zero":
        to_none = rng.random() < 0.5
        for opt in opts.values():
            opt.zero_grad(set_to_none=to_none)
    elif op == "hyper":
        gi = rng.randrange(len(opts["t"].param_groups))
        key, value = rng.choice([("lr", 1e-3), ("lr", 0.2), ("betas", (0.8, 0.95)),
                                 ("weight_decay", 0.3), ("eps", 1e-4)])
        for opt in opts.values():
            opt.param_groups[gi][key] = value
    elif op == "add_group":
        value = torch.randn(4, generator=gen)
        for k in "to":
            p = torch.nn.Parameter(value.clone())
            params[k].append(p)
            opts[k].add_param_group({"params": [p], "lr": 0.03})
    elif op == "pop":
        gi = next((i for i, g in enumerate(opts["t"].param_groups) if len(g["params"]) > 1), None)
        if gi is None:
            return False
        for opt in opts.values():
            opt.state.pop(opt.param_groups[gi]["params"].pop(), None)
    elif params["t"]:  # one parameter's gradient, data or state
        i = rng.randrange(len(params["t"]))
        for k in "to":
            p, state = params[k][i], opts[k].state
            if op == "no_grad":
                p.grad = None
            elif op == "swap_data":
                p.data = p.data.clone()
            elif op == "edit_param":
                with torch.no_grad():
                    p.mul_(0.5)
            elif op == "drop_state":
                state.pop(p, None)
            elif state.get(p):  # swap_state
                state[p]["exp_avg"] = state[p]["exp_avg"].clone()
    else:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("first_seed", range(0, 400, 100))
def test_random_sequences_of_optimizer_operations_match_torch(first_seed):
    for seed in range(first_seed, first_seed + 100):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        pair = _Pair(rng, gen)
        ops = []
        clipped, stepped_since_clip = False, False
        for _ in range(rng.randint(5, 40)):
            op = rng.choice(OPERATIONS)
            if op in ("grads", "zero"):
                clipped = stepped_since_clip = False
            if op == "clip":
                clipped = pair.clip(rng.choice([0.1, 1.0, 100.0])) or clipped
            elif op == "step" and clipped and stepped_since_clip:
                continue  # torch's gradients stay clipped for a second step, ours do not
            elif op == "load":
                pair.load(fresh=not clipped and rng.random() < 0.5)  # the pending clip is ours
            elif not _apply(pair, op, rng, gen):
                continue
            stepped_since_clip |= op == "step" and clipped
            ops.append(op)
            pair.assert_equal((seed, ops))
