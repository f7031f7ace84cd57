"""DeepNestedOptimizer checkpoints beyond the resume tests (tests/deep_nested/test_deep_nested.py
and tests/cms/test_deep_nested_cms.py): the layouts both ways with the reference (a compiled
reference's module keys, a CMS state assigned or read through optimizer.state, 0-d parameters, an
AdamW-mode checkpoint loaded in CMS mode, the rates the saved groups hold) and checkpoints that do
not fit, refused before the first write with the part named.
"""

import copy
import re

import pytest
import torch

import titanmac_c
from titanmac_c.testing.reference_dno import ReferenceDeepNestedOptimizer
from conftest import assert_same_state, checkpoint_roundtrip, reference_and_ours
from dno_models import MODE_IDS, MODES, loss_fn, make_mlp_10_32_5, step_all, synthetic_batches


@pytest.mark.parametrize("use_preprocessing", [True, False])
def test_checkpoints_of_a_compiled_reference_load_both_ways(use_preprocessing):
    """With use_compile=True the reference's modules are torch.compile wrappers, whose
    state_dict keys carry '_orig_mod.'; ours keeps that layout with use_compile=True and loads
    either layout."""
    kw = dict(use_cms_updates=True, use_preprocessing=use_preprocessing, use_compile=True)
    ref = ReferenceDeepNestedOptimizer(make_mlp_10_32_5(seed=0), **kw)
    ours = titanmac_c.DeepNestedOptimizer(make_mlp_10_32_5(seed=0), **kw)
    saved = checkpoint_roundtrip(ref.state_dict())
    for module in ("momentum_mlp", "controller"):
        assert list(ours.state_dict()[module]) == list(saved[module])
        assert all(k.startswith("_orig_mod.") for k in saved[module])
    ours.load_state_dict(saved)
    for module in ("momentum_mlp", "controller"):
        for k, v in getattr(ours, module).state_dict().items():
            assert torch.equal(v, saved[module]["_orig_mod." + k]), (module, k)
    # ours back into a compiled reference, and a plain optimizer of ours loads it too
    ref2 = ReferenceDeepNestedOptimizer(make_mlp_10_32_5(seed=1), **kw)
    ref2.load_state_dict(checkpoint_roundtrip(ours.state_dict()))
    plain = titanmac_c.DeepNestedOptimizer(make_mlp_10_32_5(seed=1),
                                           **dict(kw, use_compile=False))
    plain.load_state_dict(checkpoint_roundtrip(ours.state_dict()))
    for module in ("momentum_mlp", "controller"):
        for k, v in getattr(plain, module).state_dict().items():
            assert torch.equal(v, saved[module]["_orig_mod." + k]), (module, k)
            assert torch.equal(v, getattr(ref2, module).state_dict()["_orig_mod." + k])


def test_checkpoint_groups_hold_the_rates_used_and_param_groups_can_be_assigned():
    """The reference writes base_lr * mu_g into AdamW's groups every step (a host read per step
    that ours does not make): its checkpoints hold the last step's rates, and so do ours. The
    reference's param_groups setter stores the value without effect (wrappers such as
    Accelerate's assign it); ours too."""
    (model_r, ref), (model_o, ours) = reference_and_ours(make_mlp_10_32_5(seed=0),
                                                         weight_decay=0.01)
    for step in range(1, 12):
        step_all(step, (model_r, ref), (model_o, ours))
    saved_r = ref.state_dict()["base_optimizer"]["param_groups"]
    saved_o = ours.state_dict()["base_optimizer"]["param_groups"]
    assert [g["lr"] for g in saved_o] == pytest.approx([g["lr"] for g in saved_r], rel=1e-6)
    assert [g["lr"] for g in saved_o] != pytest.approx([1e-3, 1e-3], rel=1e-3)  # mu moved them
    groups = ours.param_groups
    ours.param_groups = []
    assert ours.param_groups is groups
    before = [p.detach().clone() for p in model_o.parameters()]
    step_all(12, (model_o, ours))
    assert not all(torch.equal(a, p) for a, p in zip(before, model_o.parameters()))


class WithScalar(torch.nn.Module):
    """A linear layer and a 0-d parameter (a learnable temperature)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 4)
        self.temperature = torch.nn.Parameter(torch.tensor(0.7))


def test_cms_state_assigned_as_on_the_reference():
    """The reference's ways to edit one tensor's CMS state by assignment: a fresh
    ContinuumMemoryState for optimizer.state[p] (a reset), a tensor for a level's momentum. Both
    reach the live state and the runs go on alike (the legacy network: no resync needed);
    assignments the state cannot take raise, nothing written."""
    from titanmac_c.testing.reference_dno import ContinuumMemoryState

    kw = dict(use_cms_updates=True, use_preprocessing=False, cms_frequencies=[1, 3, 9])
    torch.manual_seed(0)
    (model_r, ref), (model_o, ours) = reference_and_ours(make_mlp_10_32_5(seed=0), **kw)
    for step in range(1, 6):
        step_all(step, (model_r, ref), (model_o, ours))
    for model, opt in ((model_r, ref), (model_o, ours)):
        w, b = model[0].weight, model[2].bias
        opt.state[w] = ContinuumMemoryState(w.shape, opt.cms_frequencies, w.device)
        opt.state[b].levels[0].momentum = torch.full_like(b, 0.5)
    w_index = ours._cms.index[model_o[0].weight]
    assert torch.count_nonzero(ours._cms.buffers["momentum"][1][w_index]) == 0
    assert ours.state[model_o[0].weight].levels[1].step_count == 0
    for step in range(6, 12):
        step_all(step, (model_r, ref), (model_o, ours))
    for pr, po in zip(model_r.parameters(), model_o.parameters()):
        torch.testing.assert_close(po, pr, rtol=1e-5, atol=1e-7)
        for lr_, lo in zip(ref.state[pr].levels, ours.state[po].levels):
            torch.testing.assert_close(lo.momentum, lr_.momentum, rtol=1e-5, atol=1e-7)
            assert lo.step_count == lr_.step_count
    b = model_o[2].bias
    before = checkpoint_roundtrip(ours.state_dict())
    with pytest.raises(ValueError, match=r"momentum of CMS level 0: \(3,\), expected a tensor "
                                         r"of shape \(5,\)"):
        ours.state[b].levels[0].momentum = torch.zeros(3)
    with pytest.raises(ValueError, match="ema_grad of CMS level 1: not kept by titanmac_c"):
        ours.state[b].levels[1].ema_grad = torch.zeros_like(b)
    with pytest.raises(ValueError, match="expected a CMS state with 3 levels"):
        ours.state[b] = ContinuumMemoryState(b.shape, [1, 10], b.device)
    with pytest.raises(KeyError, match="not a parameter of this optimizer"):
        ours.state[torch.nn.Parameter(torch.zeros(5))] = ours.state[b]
    assert_same_state(checkpoint_roundtrip(ours.state_dict()), before)


def test_an_adamw_mode_checkpoint_resets_the_cms_state_as_the_references():
    """The reference saves an all-zero cms_state in AdamW mode (ours: {}); loaded into a CMS
    optimizer that has trained, both leave every CMS buffer and count at zero."""
    kw = dict(use_cms_updates=True, use_preprocessing=False)
    torch.manual_seed(0)
    (model_r, ref), (model_o, ours) = reference_and_ours(make_mlp_10_32_5(seed=0), **kw)
    for step in range(1, 13):
        step_all(step, (model_r, ref), (model_o, ours))
    for cls, opt in ((ReferenceDeepNestedOptimizer, ref), (titanmac_c.DeepNestedOptimizer, ours)):
        source_model = make_mlp_10_32_5(seed=1)
        source = cls(source_model, use_preprocessing=False)  # AdamW mode, the same networks
        for step in range(1, 3):
            step_all(step, (source_model, source))
        opt.load_state_dict(checkpoint_roundtrip(source.state_dict()))
    for pr, po in zip(model_r.parameters(), model_o.parameters()):
        for lr_, lo in zip(ref.state[pr].levels, ours.state[po].levels):
            assert torch.count_nonzero(lr_.momentum) == torch.count_nonzero(lo.momentum) == 0
            assert torch.count_nonzero(lo.accumulated_grad) == 0
            assert lo.step_count == lr_.step_count == 0


@pytest.mark.parametrize("kw", MODES[1:], ids=MODE_IDS[1:])
def test_cms_state_reads_like_the_references_and_0d_parameters_checkpoint(kw):
    """optimizer.state[p] in CMS mode has the reference's ContinuumMemoryState surface over the
    live buffers; a model with a 0-d parameter checkpoints (its zero placeholders included) and
    the checkpoint loads both ways."""
    torch.manual_seed(0)
    kw = dict(kw, cms_frequencies=[1, 3, 9])
    (model_r, ref), (model_o, ours) = reference_and_ours(WithScalar(), **kw)
    for step in range(1, 8):
        step_all(step, (model_r, ref), (model_o, ours))
    for pr, po in zip(model_r.parameters(), model_o.parameters()):
        st_r, st_o = ref.state[pr], ours.state[po]
        assert st_o.frequencies == st_r.frequencies
        assert len(st_o.levels) == len(st_r.levels)
        for lr_, lo in zip(st_r.levels, st_o.levels):
            assert (lo.frequency, lo.step_count, lo.beta2) == (lr_.frequency, lr_.step_count,
                                                                lr_.beta2)
            assert lo.ema_decay == pytest.approx(lr_.ema_decay, rel=1e-12)
            assert lo.momentum.shape == lr_.momentum.shape == po.shape
            torch.testing.assert_close(lo.momentum, lr_.momentum, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(lo.accumulated_grad, lr_.accumulated_grad, rtol=1e-5,
                                       atol=1e-7)
        assert [st_o.should_update(lv, t) for lv in range(3) for t in range(1, 10)] == \
               [st_r.should_update(lv, t) for lv in range(3) for t in range(1, 10)]
    # live buffers: a write through the view is the optimizer's state
    po = model_o.temperature
    ours.state[po].levels[0].momentum.fill_(0.25)
    ours.state[po].levels[2].step_count = 5
    assert float(ours._cms.buffers["momentum"][0][ours._cms.index[po]]) == 0.25
    assert int(ours._cms.step_counts[ours._cms.index[po]][2]) == 5
    saved = checkpoint_roundtrip(ours.state_dict())
    i = ours._cms.index[po]
    assert saved["cms_state"][i][1]["v_sq"].shape == ()
    back = ReferenceDeepNestedOptimizer(copy.deepcopy(model_o), **kw)
    back.load_state_dict(saved)
    assert float(back.state[back.model.temperature].levels[0].momentum) == 0.25
    assert back.state[back.model.temperature].levels[2].step_count == 5
    again = titanmac_c.DeepNestedOptimizer(copy.deepcopy(model_o), **kw)
    again.load_state_dict(checkpoint_roundtrip(ref.state_dict()))
    assert again.global_step == ref.global_step == 7


def test_cms_checkpoint_groups_hold_base_lr_as_the_references():
    """In CMS mode the reference's AdamW groups are never written (the update is the CMS one):
    its checkpoints hold base_lr there, and so do ours."""
    (model_r, ref), (model_o, ours) = reference_and_ours(make_mlp_10_32_5(seed=0),
                                                         use_cms_updates=True,
                                                         use_preprocessing=False)
    for step in range(1, 6):
        step_all(step, (model_r, ref), (model_o, ours))
    assert ours.get_effective_lrs() != pytest.approx([1e-3, 1e-3], rel=1e-4)  # mu moved
    saved_r = ref.state_dict()["base_optimizer"]["param_groups"]
    saved_o = ours.state_dict()["base_optimizer"]["param_groups"]
    assert [g["lr"] for g in saved_o] == [g["lr"] for g in saved_r] == [1e-3, 1e-3]


def _bad_checkpoints(sd):
    """(description, checkpoint) pairs, each wrong in one part that load_state_dict reaches
    after others it could already have written."""
    def edit(fn):
        bad = copy.deepcopy(sd)
        fn(bad)
        return bad

    def wider_controller(bad):
        bad["controller"] = {k: torch.zeros(tuple(s + 1 for s in v.shape))
                             for k, v in bad["controller"].items()}

    out = [("controller shapes", edit(wider_controller)),
           ("lr_multipliers length", edit(lambda b: b.update(lr_multipliers=torch.ones(3)))),
           ("lr_multipliers of one element",
            edit(lambda b: b.update(lr_multipliers=torch.ones(1)))),
           ("global_step", edit(lambda b: b.update(global_step=-1))),
           ("meta_optimizer groups", edit(lambda b: b["meta_optimizer"]["param_groups"][0]
                                          .update(params=[0]))),
           ("meta_optimizer without state", edit(lambda b: b["meta_optimizer"].pop("state"))),
           ("lr_multipliers a string", edit(lambda b: b.update(lr_multipliers="abc"))),
           ("lr_multipliers NaN",
            edit(lambda b: b.update(lr_multipliers=torch.tensor([1.0, float("nan")])))),
           ("ema_loss inf", edit(lambda b: b.update(ema_loss=torch.tensor([float("inf"), 0.0])))),
           ("meta_trainer a list", edit(lambda b: b.update(meta_trainer=[1.0]))),
           ("meta_trainer lists of two lengths", edit(lambda b: b.update(meta_trainer=dict(
               loss_history=[1.0], multiplier_history=[], momentum_history=[])))),
           ("meta_trainer loss a string", edit(lambda b: b.update(meta_trainer=dict(
               loss_history=["abc"], multiplier_history=[torch.ones(2)],
               momentum_history=[0.0])))),
           ("meta_trainer multipliers of 3", edit(lambda b: b.update(meta_trainer=dict(
               loss_history=[1.0], multiplier_history=[torch.ones(3)],
               momentum_history=[0.0]))))]
    if sd["meta_optimizer"]["state"]:
        out.append(("meta_optimizer exp_avg shape", edit(
            lambda b: next(iter(b["meta_optimizer"]["state"].values())).update(
                exp_avg=torch.zeros(2, 2)))))
    if sd["base_optimizer"]["state"]:
        out += [("AdamW exp_avg shape", edit(lambda b: b["base_optimizer"]["state"][0].update(
                    exp_avg=torch.zeros(3)))),
                ("AdamW step a string", edit(lambda b: b["base_optimizer"]["state"][2].update(
                    step="12"))),
                ("AdamW step inf", edit(lambda b: b["base_optimizer"]["state"][2].update(
                    step=torch.tensor(float("inf")))))]
    if sd["cms_state"]:
        last = max(sd["cms_state"])
        first = min(sd["cms_state"])  # 0.weight, [32, 10]
        out += [("cms momentum shape", edit(lambda b: b["cms_state"][last][0].update(
                    momentum=torch.zeros(3)))),
                ("cms momentum transposed", edit(lambda b: b["cms_state"][first][0].update(
                    momentum=torch.ones(10, 32)))),
                ("cms momentum broadcastable", edit(lambda b: b["cms_state"][first][0].update(
                    momentum=torch.ones(1, 10)))),
                ("cms levels", edit(lambda b: b["cms_state"][last].update(
                    {7: copy.deepcopy(b["cms_state"][last][0])}))),
                ("cms level a list", edit(lambda b: b["cms_state"][last].update({0: [1, 2]}))),
                ("cms keys flattened to strings", edit(lambda b: b.update(
                    cms_state={str(i): levels for i, levels in b["cms_state"].items()}))),
                ("cms step_count a string", edit(lambda b: b["cms_state"][last][0].update(
                    step_count="3"))),
                ("cms step_count beyond float32", edit(lambda b: b["cms_state"][last][0].update(
                    step_count=10**40))),
                ("cms step_count negative", edit(lambda b: b["cms_state"][last][0].update(
                    step_count=-1))),
                ("cms momentum sparse", edit(lambda b: b["cms_state"][first][0].update(
                    momentum=torch.zeros(32, 10).to_sparse()))),
                ("cms momentum complex", edit(lambda b: b["cms_state"][first][0].update(
                    momentum=torch.zeros(32, 10, dtype=torch.complex64)))),
                ("cms momentum on meta", edit(lambda b: b["cms_state"][last][0].update(
                    momentum=torch.zeros_like(b["cms_state"][last][0]["momentum"],
                                              device="meta")))),
                ("Phase 1 output of another shape", edit(lambda b: b.update(
                    mlp_output_history={first: torch.zeros(10, 32)}))),
                ("Phase 1 output of no tensor", edit(lambda b: b.update(
                    mlp_output_history={first: torch.zeros(32, 10), last + 1: torch.zeros(1)}))),
                ("Phase 1 outputs keyed by strings", edit(lambda b: b.update(
                    mlp_output_history={"0": torch.zeros(32, 10)})))]
    if "mlp_optimizer" in sd:
        out += [("mlp_optimizer groups", edit(lambda b: b["mlp_optimizer"]["param_groups"][0]
                                              ["params"].pop())),
                ("mlp_optimizer without state", edit(lambda b: b["mlp_optimizer"].pop("state")))]
    return out


@pytest.mark.parametrize("part, kw", [
    ("meta_optimizer", dict(meta_update_freq=2)),
    ("mlp_optimizer", dict(use_cms_updates=True)),  # Phase 1 at step 5 gives it state
])
def test_a_meta_optimizer_state_that_does_not_fit_its_network_is_refused(part, kw):
    """torch's Adam loads a state tensor of another shape than its parameter and fails at its
    next step: refused at the load, naming it, nothing loaded."""
    model = make_mlp_10_32_5(seed=0)
    opt = titanmac_c.DeepNestedOptimizer(model, **kw)
    for step, batch in enumerate(synthetic_batches("mlp", 6, seed=4), start=1):
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step(float(step))
    bad = checkpoint_roundtrip(opt.state_dict())
    entry = next(iter(bad[part]["state"].values()))
    entry["exp_avg"] = torch.zeros(entry["exp_avg"].numel() + 1)
    before = checkpoint_roundtrip(opt.state_dict())
    with pytest.raises(ValueError, match=rf"state_dict\['{part}'\]: param_groups\[0\]\['params'\]"
                                         r"\[\d+\]: exp_avg is \(\d+,\), the parameter"):
        opt.load_state_dict(bad)
    assert_same_state(checkpoint_roundtrip(opt.state_dict()), before)


@pytest.mark.parametrize("kw", MODES, ids=MODE_IDS)
def test_a_checkpoint_that_does_not_fit_raises_and_loads_nothing(kw):
    """Every part is checked before load_state_dict writes: a refused checkpoint leaves the
    optimizer bit for bit as it was (it had loaded the AdamW state, the modules, global_step and
    part of the CMS state before raising), and after the good checkpoint training continues as
    an untouched twin's. The bad checkpoints are edits of one taken two steps earlier, so that a
    part loaded before the refusal would show."""
    twins = []
    for _ in range(2):
        model = make_mlp_10_32_5(seed=0)
        torch.manual_seed(1)  # the same networks' initial weights
        twins.append((model, titanmac_c.DeepNestedOptimizer(model, meta_update_freq=1000, **kw)))
    batches = synthetic_batches("mlp", 8, seed=4)
    for step, batch in enumerate(batches[:5], start=1):
        for model, opt in twins:
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step(float(step))
        if step == 3:
            earlier = checkpoint_roundtrip(twins[1][1].state_dict())
    (model, opt), (model_twin, twin) = twins
    good = checkpoint_roundtrip(twin.state_dict())
    for what, bad in _bad_checkpoints(earlier):
        before = checkpoint_roundtrip(opt.state_dict())
        with pytest.raises((ValueError, RuntimeError, KeyError)):
            opt.load_state_dict(bad)
        assert_same_state(checkpoint_roundtrip(opt.state_dict()), before, what)
    opt.load_state_dict(good)
    for batch in batches[5:]:
        for m, o in twins:
            o.zero_grad()
            loss_fn(m, batch).backward()
            o.step(1.0)
    for p, q in zip(model.parameters(), model_twin.parameters()):
        assert torch.equal(p, q)


def test_histories_that_do_not_fit_are_named():
    """The meta-trainer's and Phase 1's histories (keys the reference's checkpoints lack) are
    checked as the other parts: a misfit raises naming the entry and loads nothing."""
    model = make_mlp_10_32_5(seed=0)
    opt = titanmac_c.DeepNestedOptimizer(model, use_cms_updates=True)
    sd = opt.state_dict()
    sd["meta_trainer"]["loss_history"] = [2.0, None]
    sd["meta_trainer"]["multiplier_history"] = [torch.ones(2)] * 2
    sd["meta_trainer"]["momentum_history"] = [0.0, 0.0]
    with pytest.raises(ValueError, match=r"^state_dict\['meta_trainer'\]\['loss_history'\]\[1\]: "
                                         r"None, expected a number$"):
        opt.load_state_dict(sd)
    sd = opt.state_dict()
    sd["mlp_output_history"] = {1: torch.zeros(7, 7)}
    shape = re.escape(str(tuple(opt._cms.params[1].shape)))  # tensor 1 in group order
    with pytest.raises(ValueError, match=r"^state_dict\['mlp_output_history'\]\[1\]: \(7, 7\) "
                                         r"torch.float32 torch.strided on cpu, expected a dense "
                                         rf"floating tensor of shape {shape} with values$"):
        opt.load_state_dict(sd)
    assert opt.meta_trainer.loss_history == [] and opt._cms_mode.output_history == {}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_a_cms_state_keyed_by_strings_is_named_for_what_it_is(tmp_path):
    """torch.distributed.checkpoint's load gives the int keys of non-tensor values back as
    strings: the CMS step counts land in cms_state['0'] and so on, beside the template's. The
    reference's load ignores those keys (its step counts restart); refused here, saying what the
    keys must be and how to save, and nothing is loaded."""
    from torch.distributed import checkpoint as dcp
    from torch.utils._pytree import tree_map

    model = make_mlp_10_32_5(seed=0)
    opt = titanmac_c.DeepNestedOptimizer(model, use_cms_updates=True, cms_frequencies=[1, 3])
    for step in range(4):
        step_all(step, (model, opt))
    dcp.save(opt.state_dict(), checkpoint_id=tmp_path)
    fresh = titanmac_c.DeepNestedOptimizer(make_mlp_10_32_5(seed=0), use_cms_updates=True,
                                           cms_frequencies=[1, 3])
    before = checkpoint_roundtrip(fresh.state_dict())
    # a template whose tensors DCP can write (ours saves the buffers it does not keep as
    # one-element zeros, which it cannot)
    template = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v,
                        fresh.state_dict())
    dcp.load(template, checkpoint_id=tmp_path)
    assert "0" in template["cms_state"] and 0 in template["cms_state"]
    with pytest.raises(ValueError, match=r"^cms_state\['0'\]: a str key; cms_state is keyed by "
                                         r"each tensor's position in the groups \(an int\)\. "
                                         r"torch\.distributed\.checkpoint's load gives such keys "
                                         r"back as strings: save this optimizer's state_dict\(\) "
                                         r"with torch\.save$"):
        fresh.load_state_dict(template)
    assert_same_state(fresh.state_dict(), before)


@pytest.mark.parametrize("key, value", [
    ("lr_multipliers", [1.0, float("nan")]), ("lr_multipliers", [float("inf"), 1.0]),
    ("ema_loss", [0.5, float("nan")]), ("ema_loss", [float("-inf"), 0.5])])
def test_non_finite_multipliers_or_loss_ema_are_refused_by_name(key, value):
    """Neither the controller nor a step writes a non-finite multiplier or loss EMA; loaded from a
    corrupted checkpoint, a NaN multiplier would turn every parameter NaN at the next step that
    does not run the controller (controller_update_freq > 1). Refused, naming the key, nothing
    loaded."""
    model = make_mlp_10_32_5(seed=0)
    opt = titanmac_c.DeepNestedOptimizer(model, controller_update_freq=3)
    for step, batch in enumerate(synthetic_batches("mlp", 2, seed=4), start=1):
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step(float(step))
    bad = checkpoint_roundtrip(opt.state_dict())
    bad[key] = torch.tensor(value)
    before = checkpoint_roundtrip(opt.state_dict())
    with pytest.raises(ValueError, match=rf"^state_dict\['{key}'\]: .*non-finite"):
        opt.load_state_dict(bad)
    assert_same_state(checkpoint_roundtrip(opt.state_dict()), before, key)
