"""``load_state_dict`` checks the whole dictionary first: a mismatch is one ValueError naming the group, the
parameter and the problem, and the optimizer stays bitwise as it was (issue 15, observation 9). Master weights
turned on or off between save and load convert."""

from __future__ import annotations

import pytest
import torch

from optim_factory import PortableFusedAdam
from tests.helpers import LiveSnapshot, assert_bitwise, clone_params, deep_clone, make_params, run_steps

HP = dict(lr=1e-2, weight_decay=0.1)


def _trained(dtype=torch.float32, shapes=((4, 3), (5,)), **kw):
    params = make_params(dtype, shapes=list(shapes))
    opt = PortableFusedAdam(params, **HP, **kw)
    run_steps(opt, params, 0, 2)
    return params, opt


def _mutations():
    """(what, how to damage an exported state dict, words the error must contain)."""

    def shape(sd):
        sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"][:1]  # (1, 3) into a (4, 3) parameter

    def one_moment(sd):
        del sd["state"][1]["exp_avg_sq"]

    def unknown(sd):
        sd["state"][1]["momentum_buffer"] = torch.zeros(5)

    def adamw(sd):
        for g in sd["param_groups"]:
            del g["bias_correction"]

    def groups(sd):
        sd["param_groups"].append(dict(sd["param_groups"][0], params=[]))

    def sizes(sd):
        sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:1]

    def dtype(sd):
        sd["state"][1]["exp_avg"] = sd["state"][1]["exp_avg"].to(torch.float64)

    def int16(sd):  # remainders belong to the master of a BF16 parameter only
        sd["state"][1]["exp_avg"] = torch.zeros(5, dtype=torch.int16)

    def no_step(sd):  # loaded, the bias correction would restart at step 1 under the moments of step 2
        for g in sd["param_groups"]:
            del g["step"]

    def no_step_and_not_a_dict(sd):  # not "Boolean value of Tensor ... is ambiguous" from the step check
        no_step(sd)
        for key in sd["state"]:
            sd["state"][key] = torch.zeros(2)  # bool() of it raises: the check must not take it

    def group_value(key, value):
        def damage(sd):  # loaded, lr=nan would leave non-finite weights after one step
            sd["param_groups"][0][key] = value

        return damage

    def non_finite(key, name, value, dtype=torch.float32):
        def damage(sd):  # loaded, the next step would train the parameter to NaN
            sd["state"][key][name] = sd["state"][key][name].to(dtype, copy=True)
            sd["state"][key][name].view(-1)[-1] = value

        return damage

    def stray(key):
        def damage(sd):  # loaded, the states of parameter 0 would be dropped without a word, its step kept
            sd["state"][key] = sd["state"].pop(0)

        return damage

    def state_list(sd):  # not an AttributeError with a traceback
        sd["state"] = list(sd["state"].values())

    def layout(make):
        def damage(sd):  # loaded, it would fail half-way, leaving the optimizer half-loaded
            sd["state"][1]["exp_avg"] = make()

        return damage

    return [
        ("no step", no_step, ["group 0 has states but no 'step'", "restart at step 1"]),
        ("not a dict", no_step_and_not_a_dict, ["group 0, parameter 0", "expected a dict of states"]),
        ("lr nan", group_value("lr", float("nan")), ["group 0", "Invalid learning rate: nan"]),
        ("lr negative", group_value("lr", -1.0), ["group 0", "Invalid learning rate: -1.0"]),
        ("beta2", group_value("betas", (0.9, 1.5)), ["group 0", "beta parameter at index 1: 1.5"]),
        ("eps", group_value("eps", -1.0), ["group 0", "Invalid epsilon value: -1.0"]),
        ("weight decay", group_value("weight_decay", "x"), ["group 0", "Invalid weight_decay value: 'x'"]),
        ("sparse", layout(lambda: torch.zeros(5).to_sparse()), ["parameter 1", "exp_avg", "torch.sparse_coo"]),
        ("meta", layout(lambda: torch.empty(5, device="meta")), ["parameter 1", "exp_avg", "on meta", "dense"]),
        ("nan", non_finite(1, "exp_avg_sq", float("nan")), ["group 0, parameter 1: exp_avg_sq", "NaN or inf"]),
        ("inf", non_finite(0, "exp_avg", float("-inf")), ["group 0, parameter 0: exp_avg", "NaN or inf"]),
        ("bf16 nan", non_finite(0, "exp_avg", float("nan"), torch.bfloat16), ["parameter 0: exp_avg", "NaN or inf"]),
        ("negative v", non_finite(1, "exp_avg_sq", -1e-3), ["parameter 1: exp_avg_sq holds negative values"]),
        ("step negative", group_value("step", -3), ["group 0", "step=-3", "step count"]),  # loaded: NaN weights
        ("step str", group_value("step", "2"), ["group 0", "step='2'", "step count"]),  # loaded: TypeError in step()
        ("step float", group_value("step", 2.5), ["group 0", "step=2.5", "step count"]),
        ("step zero", group_value("step", 0), ["group 0 has states but a zero 'step'"]),
        ("bias correction", group_value("bias_correction", "no"), ["group 0", "bias_correction='no'"]),
        ("amsgrad", group_value("amsgrad", True), ["group 0", "amsgrad=True: optimizer-wide"]),
        ("stray key", stray(7), ["states for 7, which no parameter group lists"]),
        ("string key", stray("0"), ["states for '0', which no parameter group lists"]),
        ("state list", state_list, ["'state' is a list, expected a dict"]),
        ("shape", shape, ["group 0, parameter 0", "exp_avg", "(1, 3)", "(4, 3)"]),
        ("one moment", one_moment, ["group 0, parameter 1", "exp_avg", "not the other moment"]),
        ("unknown state", unknown, ["group 0, parameter 1", "momentum_buffer", "unknown state"]),
        ("adamw dict", adamw, ["group 0", "bias_correction", "not a FusedAdam state dict"]),
        ("group count", groups, ["2 parameter group(s)", "1"]),
        ("group size", sizes, ["group 0 has 1 parameter(s)", "2 in the optimizer"]),
        ("dtype", dtype, ["group 0, parameter 1", "torch.float64"]),
        ("int16", int16, ["group 0, parameter 1", "torch.int16"]),
    ]


@pytest.mark.parametrize("what,damage,words", _mutations(), ids=[m[0] for m in _mutations()])
def test_a_bad_state_dict_is_one_line_and_changes_nothing(what, damage, words):
    _, saved = _trained()
    sd = deep_clone(saved.state_dict())
    damage(sd)
    params, opt = _trained()
    run_steps(opt, params, 2, 1)  # different values from the saved ones: a partial load would show
    opt.param_groups[0]["lr"] = 0.5
    before = LiveSnapshot.take(opt)
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(sd)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message
    LiveSnapshot.take(opt).assert_same(before)
    run_steps(opt, params, 3, 1)  # and it still steps


def test_param_names_are_named_in_errors():
    _, saved = _trained()
    sd = deep_clone(saved.state_dict())
    sd["param_groups"][0]["param_names"] = ["lm_head.weight", "norm.bias"]
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"][:1]
    _, opt = _trained()
    with pytest.raises(ValueError, match=r"group 0, parameter 0 \(lm_head.weight\): exp_avg has shape"):
        opt.load_state_dict(sd)


def test_states_of_other_parameters_are_refused_by_name():
    """Two parameters of one shape, their names swapped in the dictionary: loaded by index, each state would
    land on the other parameter (and the optimizer's own names would be overwritten)."""

    def named():
        params = make_params(torch.float32, shapes=[(4, 3), (4, 3)])
        opt = PortableFusedAdam(list(zip(["encoder.weight", "decoder.weight"], params)), **HP)
        run_steps(opt, params, 0, 2)
        return params, opt

    _, saved = named()
    sd = deep_clone(saved.state_dict())
    sd["param_groups"][0]["param_names"] = ["decoder.weight", "encoder.weight"]
    params, opt = named()
    before = LiveSnapshot.take(opt)
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(sd)
    assert str(info.value) == (
        "load_state_dict: group 0, parameter 0 is 'decoder.weight' in the state dict, parameter 1 ('decoder.weight') "
        "in the optimizer: the states would load into another parameter"
    )
    LiveSnapshot.take(opt).assert_same(before)
    assert opt.param_groups[0]["param_names"] == ["encoder.weight", "decoder.weight"]
    opt.load_state_dict(deep_clone(saved.state_dict()))  # the same names load
    # a wrapper's prefix (DDP's module., torch.compile's _orig_mod.): loaded by position, as torch loads, with a word
    renamed = deep_clone(saved.state_dict())
    renamed["param_groups"][0]["param_names"] = ["_orig_mod.encoder.weight", "_orig_mod.decoder.weight"]
    with pytest.warns(UserWarning, match=r"names its parameters differently \(parameter 0: '_orig_mod.encoder"):
        opt.load_state_dict(renamed)
    # a prefix and a permutation together: still refused (the names without wrapper parts are compared)
    both = deep_clone(saved.state_dict())
    both["param_groups"][0]["param_names"] = ["module.decoder.weight", "module.encoder.weight"]
    with pytest.raises(ValueError, match=r"parameter 0 is 'module.decoder.weight' in the state dict, parameter 1"):
        opt.load_state_dict(both)
    short = deep_clone(saved.state_dict())
    short["param_groups"][0]["param_names"] = []
    with pytest.raises(ValueError, match=r"group 0 has 0 param_names for 2 parameters"):
        opt.load_state_dict(short)


def test_torch_adamw_state_dict_is_refused_in_one_line():
    params = make_params(torch.float32, shapes=[(4, 3), (5,)])
    adamw = torch.optim.AdamW(params, lr=1e-2)
    run_steps(adamw, params, 0, 1)
    _, opt = _trained()
    with pytest.raises(ValueError, match="not a FusedAdam state dict"):
        opt.load_state_dict(adamw.state_dict())


@pytest.mark.parametrize("remainders", [False, True], ids=["fp32-master", "remainders"])
def test_master_weights_turned_on_start_from_the_parameter(remainders):
    params, opt = _trained(torch.bfloat16)
    sd = deep_clone(opt.state_dict())
    kw = dict(master_weights=True, store_param_remainders=remainders)
    restored_params = clone_params(params)
    restored = PortableFusedAdam(restored_params, **HP, **kw)
    restored.load_state_dict(sd)
    for p in restored_params:
        master = restored.get_unscaled_state(p, "master_param")
        expected = torch.zeros_like(p, dtype=torch.int16) if remainders else p.detach().float()
        assert_bitwise(master, expected, "master starts as the parameter")
    before = [p.detach().clone() for p in restored_params]
    run_steps(restored, restored_params, 2, 2)  # steps with the master (no KeyError)
    assert all(not torch.equal(a, b) for a, b in zip(before, restored_params))


def test_master_weights_turned_off_drop_the_master():
    params, opt = _trained(torch.bfloat16, master_weights=True)
    sd = deep_clone(opt.state_dict())
    restored = PortableFusedAdam(clone_params(params), **HP)
    restored.load_state_dict(sd)
    assert all("master_param" not in st for st in restored.state.values())
    assert set(restored.state_dict()["state"][0]) == {"exp_avg", "exp_avg_sq"}
