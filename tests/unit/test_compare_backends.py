"""scripts/compare_backends.py on CPU: its configuration list, its comparison, its verdict and its CLI.

The GPU run (PortableFusedAdam against TE) needs CUDA and TE; here the twin is compared with itself.
"""

from __future__ import annotations

import json

import pytest
import torch

from scripts import compare_backends as cb


def test_configurations_cover_every_state_layout():
    names = [c.name for c in cb.CONFIGS]
    assert len(names) == len(set(names))
    kws = [c.kwargs for c in cb.CONFIGS]
    assert any(k.get("adam_w_mode") is False for k in kws)  # L2
    assert any(k.get("store_param_remainders") and "exp_avg_dtype" not in k for k in kws)
    assert any(k.get("store_param_remainders") and k.get("exp_avg_dtype") == torch.bfloat16 for k in kws)
    assert any(k.get("master_weight_dtype") == torch.float16 for k in kws)
    assert any(c.param_dtype == torch.float16 for c in cb.CONFIGS)
    assert any(c.param_dtype == torch.bfloat16 and k.get("master_weights") for c, k in zip(cb.CONFIGS, kws))
    for dtype in (torch.float16, cb.FP8, torch.bfloat16):
        assert any(k.get("exp_avg_dtype") == dtype == k.get("exp_avg_sq_dtype") for k in kws), dtype
    assert any(k.get("capturable") and "exp_avg_dtype" not in k for k in kws)
    assert any(k.get("capturable") and k.get("exp_avg_dtype") == torch.bfloat16 for k in kws)
    assert any(k.get("bias_correction") is False for k in kws)
    assert set(cb.GRAD_SCALES) == {"normal", "eps"} and len(cb.LRS) == 2


@pytest.mark.parametrize("config", cb.CONFIGS, ids=[c.name for c in cb.CONFIGS])
def test_portable_against_itself_is_bitwise(config):
    r = cb.run(
        config,
        "eps",
        1e-4,
        cls_a=cb.PortableFusedAdam,
        cls_b=cb.PortableFusedAdam,
        steps=3,
        shapes=[(8, 5), (33,)],
        device="cpu",
    )
    assert set(r["max_rel"]) >= {"params", "exp_avg", "exp_avg_sq"}
    assert ("master_param" in r["max_rel"]) == bool(config.kwargs.get("master_weights"))
    assert all(r["bitwise"].values()) and all(v == 0.0 for v in r["max_rel"].values()), r
    assert cb.verdict(r, 1e-6, bitwise=True)


def test_deviation_and_verdict_see_one_ulp():
    a = [torch.tensor([1.0, -2.0, 4.0])]
    b = [torch.nextafter(a[0], torch.tensor(5.0))]  # each element one FP32 ulp up
    rel, bitwise = cb.deviation(a, b)
    assert not bitwise and rel == pytest.approx(2**-21 / 4)  # the largest element's ulp (4: 2**-21), relative
    r = {"max_rel": {"params": rel}, "bitwise": {"params": bitwise}}
    assert cb.verdict(r, 1e-6, bitwise=False) and not cb.verdict(r, 1e-6, bitwise=True)
    assert not cb.verdict(r, rel / 2, bitwise=False)


def test_eps_gradients_are_eps_dominated():
    g = cb.grads(0, [torch.zeros(1000)], cb.GRAD_SCALES["eps"])[0]
    assert g.abs().max().item() < cb.HP["eps"] / 10  # sqrt(v_hat) ~ |g| << eps


def test_cli_writes_table_and_jsonl(tmp_path, capsys):
    rc = cb.main(
        [
            "--against",
            "portable",
            "--device",
            "cpu",
            "--small",
            "--steps",
            "2",
            "--configs",
            "fp32,bf16-moments",
            "--out",
            str(tmp_path),
            "--bitwise",
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "compare.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * len(cb.GRAD_SCALES) * len(cb.LRS) and all(r["ok"] for r in rows)
    table = (tmp_path / "compare.md").read_text()
    assert table.count("| bf16-moments |") == 4 and "**NO**" not in table


def test_cli_refuses_unknown_configuration_and_has_help(capsys):
    with pytest.raises(SystemExit) as e:
        cb.parse_args(["--configs", "fp32,bf16-moment", "--device", "cpu", "--against", "portable"])
    assert e.value.code == 2 and "bf16-moment" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cb.parse_args(["--help"])
    assert e.value.code == 0 and "--max-rel" in capsys.readouterr().out
