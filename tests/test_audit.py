"""`prismdp audit` end to end on a tiny BERT: the audit of the correct mechanism stays below the accountant's epsilon,
and it catches a mechanism whose noise was secretly cut (the audit has power)."""

import json

import pytest

from prismdp.audit.run import run_audit
from prismdp.cli import main
from prismdp.privacy.clipping import DPConfig
from prismdp.train.config import TrainConfig

# 8 steps at q = 8/32 = 0.25: an included canary is in at least one step's sample with probability 1 - 0.75^8 = 0.9
TINY = dict(steps=8, batch_size=8, synthetic_train=32, synthetic_test=8, max_length=24, micro_batch_size=16, rank=2,
            epsilon=1.0, eval_batch_size=8)


def _cfg(model_dir, out, **kw):
    return TrainConfig(model=model_dir, output=str(out), **{**TINY, **kw})


def _flags(model_dir, out, **kw):
    args = ["audit", "--model", model_dir, "--output", str(out), "--quiet"]
    for k, v in {**TINY, **kw}.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_audit_of_the_correct_mechanism_stays_below_the_claim(tiny_bert_dir, tmp_path, method):
    out = tmp_path / method
    assert main(_flags(tiny_bert_dir, out, method=method) + ["--canaries", "200"]) == 0
    rep = json.loads((out / "audit.json").read_text())
    assert rep["verdict"] == "consistent" and rep["eps_lower_bound"] <= rep["epsilon"]
    assert rep["epsilon"] == pytest.approx(json.loads((out / "privacy.json").read_text())["epsilon"])
    assert rep["m"] == 200 and 0 < rep["included"] < 200 and rep["correct"] <= rep["guesses"] <= 200
    assert {"significance", "delta", "runtime_s", "canary_seed", "threshold"} <= set(rep)
    coins = json.loads((out / "audit-canaries.json").read_text())
    assert len(coins["scores"]) == 200 and sum(coins["included"]) == rep["included"]


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_audit_detects_noise_secretly_scaled_down(tiny_bert_dir, tmp_path, monkeypatch, method):
    # the accountant still claims epsilon 1 for the calibrated sigma, but the mechanism adds 1 % of that noise
    monkeypatch.setattr(DPConfig, "noise_std", property(lambda self: 0.01 * self.noise_multiplier *
                                                        self.max_grad_norm))
    out = tmp_path / method
    assert main(_flags(tiny_bert_dir, out, method=method) + ["--canaries", "200"]) == 1
    rep = json.loads((out / "audit.json").read_text())
    assert rep["verdict"] == "violation"
    assert rep["eps_lower_bound"] > rep["epsilon"] == pytest.approx(1.0, rel=0.01)


def test_input_canaries_run_and_stay_below_the_claim(tiny_bert_dir, tmp_path):
    rep = run_audit(_cfg(tiny_bert_dir, tmp_path / "in"), 40, "input", progress=False, log=lambda *a: None)
    assert rep["canary_kind"] == "input" and rep["eps_lower_bound"] <= rep["epsilon"]
    # the included canaries were trained on: the run's dataset is the 32 examples plus them
    assert json.loads((tmp_path / "in" / "config.json").read_text())["dataset_size"] == 32 + rep["included"]


@pytest.mark.parametrize("kw,match", [
    (dict(dp=False), "no-dp"),
    (dict(), "canaries"),
])
def test_audit_refuses_what_it_cannot_audit(tiny_bert_dir, tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        run_audit(_cfg(tiny_bert_dir, tmp_path / "x", **kw), 1 if not kw else 10, progress=False)
