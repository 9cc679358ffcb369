"""Issue 29's new-user findings, one test (or a few) per finding, each failing on the behaviour the finding reports."""

import ast
import functools
import json
import math
import re
from pathlib import Path

import pytest

from helpers import run_python
from prismdp.cli import main

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- 1, 2: a delta at which epsilon 0 holds


@pytest.fixture(scope="module")
def bounded_accounting():
    """One child process (one interpreter start for both checks below), killed whole if it hangs: the CLI's answer to
    finding 1's command line, then a PLD call at sigma 0.01."""
    code = ("import contextlib, io; from prismdp.cli import main; err = io.StringIO()\n"
            "with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):\n"
            "    rc = main(['epsilon', '--target-epsilon', '3', '--sample-rate', '0.08', '--steps', '2', '--delta', "
            "'0.5', '--accountant', 'pld'])\n"
            "print(repr((rc, err.getvalue())), flush=True)\n"
            "from prismdp.privacy.accounting import _epsilon; print(_epsilon(0.01, 0.08, 2, 1e-5, 'pld'))")
    res = run_python(code, timeout=150)
    assert res.returncode == 0, res.stderr[-2000:]
    first, second = res.stdout.strip().splitlines()[-2:]
    return ast.literal_eval(first), second


def test_pld_calibration_at_a_vacuous_delta_is_refused_up_front_not_searched(bounded_accounting):
    """Finding 1: `prismdp epsilon --target-epsilon 3 --sample-rate 0.08 --steps 2 --delta 0.5 --accountant pld` ran
    for minutes (every sigma met the target, so the search went down to sigma 0.01, where PLD's grid has ~6e7 points).
    Even without noise two steps at q 0.08 are (0, 1 - 0.92^2 = 0.154)-DP: refused, before any accountant call."""
    (rc, text), _ = bounded_accounting
    assert rc == 2, text
    assert "delta=0.5 is too large for the 'pld' accountant" in text and "(0, 0.154)-DP" in text


@pytest.mark.parametrize("accountant", ["prv", "rdp", "pld"])
def test_every_accountant_refuses_the_same_vacuous_delta_before_calling_itself(accountant, monkeypatch):
    """Finding 1: the same validation, up front, for all three (PRV took 12 s to refuse; PLD never did)."""
    from prismdp.privacy import accounting

    def no_call(*a, **k):
        raise AssertionError("the accountant was called")

    monkeypatch.setattr(accounting, "_epsilon", no_call)
    for call in (lambda: accounting.calibrate_sigma(3.0, 0.5, 0.08, 2, accountant),
                 lambda: accounting.epsilon(1.0, 0.08, 2, 0.5, accountant)):
        with pytest.raises(ValueError, match=r"too large .* even epsilon 0 holds"):
            call()


def test_the_vacuous_delta_bound_is_the_no_noise_limit_of_the_pld_accountant():
    """1 - (1 - q)^T bounds the delta at epsilon 0 (total variation) of every sigma, and is its small-sigma limit:
    checked against dp-accounting's own PLD (an independent computation)."""
    from dp_accounting import dp_event, pld

    from prismdp.privacy.accounting import vacuous_delta_bound

    q, steps = 0.08, 2
    bound = vacuous_delta_bound(q, steps)
    assert bound == pytest.approx(1 - 0.92 ** 2, rel=1e-12)
    for sigma, close in ((0.02, True), (0.5, False), (2.0, False)):
        acc = pld.PLDAccountant(value_discretization_interval=1e-2)
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
        tv = acc.get_delta(0.0)
        assert tv <= bound * (1 + 1e-9)
        assert (tv == pytest.approx(bound, rel=1e-3)) == close


@pytest.mark.parametrize("accountant", ["prv", "rdp", "pld"])
def test_epsilon_command_refuses_a_delta_where_epsilon_would_be_negative(accountant, capsys):
    """Finding 2: `--sigma 1.1 --sample-rate 0.0064 --steps 300 --delta 0.5 --accountant pld` printed 0.000000 and
    exited 0 (dp-accounting returns epsilon 0 where the delta at epsilon 0 is already below the target); prv and rdp
    refused.  Here the no-noise bound (0.85) does not fire: the accountant itself must say so."""
    rc = main(["epsilon", "--sigma", "1.1", "--sample-rate", "0.0064", "--steps", "300", "--delta", "0.5",
               "--accountant", accountant])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", out
    assert f"delta=0.5 is too large for the '{accountant}' accountant" in err and "even epsilon 0 holds" in err


def test_pld_calls_at_tiny_sigmas_stay_bounded(bounded_accounting):
    """Finding 1 (time bound): a PLD call at sigma 0.01 (which a calibration may probe) built a ~6e7-point grid in a
    Python loop (minutes, gigabytes); the grid is now capped, so it answers (inf: above 100) within seconds, and
    values at ordinary sigmas keep the 1e-4 grid (unchanged)."""
    from prismdp.privacy.pld import VALUE_DISCRETIZATION, discretization

    assert bounded_accounting[1] == "inf"
    assert discretization(1.0, 0.08) == VALUE_DISCRETIZATION and discretization(0.01, 0.08) > 100 * VALUE_DISCRETIZATION


# ---------------------------------------------------------------- 3: --secure-noise with --seed


@pytest.mark.parametrize("from_config", [False, True])
def test_secure_noise_with_a_seed_says_what_the_seed_seeds(from_config, tmp_path, monkeypatch, capsys):
    """Finding 3: `--secure-noise --seed 3` (or both in --config) was accepted silently, while README said "a seed is
    refused".  Chosen: the CLI's seed never reaches the noise (build_run passes seed=None to make_private, which
    refuses a seed), it seeds initialisation, dropout and data subsets, which a secure run still wants reproducible;
    so it is accepted with a note, and the README says exactly that."""
    import prismdp.train.loop as loop

    seen = {}

    def fake_train(cfg, **kw):
        seen["cfg"] = cfg
        return loop.TrainResult({"rank": 1}, None, None)

    monkeypatch.setattr(loop, "train", fake_train)
    out = str(tmp_path / "run")
    if from_config:
        conf = tmp_path / "c.json"
        conf.write_text(json.dumps({"secure_noise": True, "seed": 3, "output": out}))
        argv = ["train", "--config", str(conf)]
    else:
        argv = ["train", "--secure-noise", "--seed", "3", "--output", out]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert seen["cfg"].seed == 3 and seen["cfg"].secure_noise
    assert "--secure-noise: seed 3 seeds only the initialisation, dropout and data subsets" in err
    readme = (ROOT / "README.md").read_text()
    assert "A seed is refused (" not in readme


# ---------------------------------------------------------------- 4, 5: the audit's output


def test_audit_on_an_existing_output_does_not_suggest_a_flag_it_lacks(tmp_path, capsys):
    """Finding 4: `prismdp audit` on a folder holding a run said "pass --resume to continue it"; audit has no --resume
    (and cannot have one: its inclusion bits live only in memory).  Refused before anything is loaded."""
    out = tmp_path / "audit"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["audit", "--output", str(out), "--canaries", "10", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--resume" not in err and "an audit cannot be resumed" in err and "another --output" in err


def test_json_files_are_strict_json_with_non_finite_values_as_strings(tmp_path):
    """Finding 5: audit.json held `"threshold": Infinity` (json.dumps' default), which strict parsers reject."""
    from prismdp.atomic import dumps_json, write_json

    def strict(text):
        def refuse(name):
            raise ValueError(f"non-standard JSON constant {name}")
        return json.loads(text, parse_constant=refuse)

    report = {"threshold": math.inf, "low": -math.inf, "score": math.nan, "ok": 1.5, "list": [math.inf, (math.nan,)]}
    write_json(tmp_path / "audit.json", report)
    back = strict((tmp_path / "audit.json").read_text())
    assert back == {"threshold": "Infinity", "low": "-Infinity", "score": "NaN", "ok": 1.5,
                    "list": ["Infinity", ["NaN"]]}
    assert float(back["threshold"]) == math.inf and math.isnan(float(back["score"]))  # float() reads them back
    assert strict(dumps_json({"loss": math.nan}))["loss"] == "NaN"  # metrics.jsonl's lines


# ---------------------------------------------------------------- 6, 8: Ctrl-C


def _interrupted_train(monkeypatch, exc):
    import prismdp.train.loop as loop

    def fake_train(cfg, **kw):
        raise exc(cfg)

    monkeypatch.setattr(loop, "train", fake_train)


def test_ctrl_c_under_torchrun_prints_a_torchrun_command_with_the_same_processes(tmp_path, monkeypatch, capsys):
    """Finding 6: under torchrun the printed command was a plain `prismdp train ... --resume`, which the world-size
    check refuses."""
    from prismdp.train.interrupt import TrainingInterrupted

    out = str(tmp_path / "run")
    _interrupted_train(monkeypatch, lambda cfg: TrainingInterrupted(3, 10, cfg.output, "SIGINT", True))
    for world, local, nodes in (("2", "2", []), ("8", "4", ["--nnodes", "2"])):
        monkeypatch.setenv("WORLD_SIZE", world)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert main(["train", "--steps", "10", "--output", out]) == 130
        again = capsys.readouterr().err.strip().splitlines()[-1].split()
        assert again == ["torchrun", *nodes, "--nproc-per-node", local, "-m", "prismdp", "train", "--steps", "10",
                         "--output", out, "--resume"]


def test_ctrl_c_before_the_first_checkpoint_does_not_promise_a_resume(tmp_path, monkeypatch, capsys):
    """Finding 8: a Ctrl-C during loading or calibration said the run "continues from its last checkpoint with
    --resume"; there is none.  With a checkpoint it prints the command that continues the run."""
    out = tmp_path / "run"
    _interrupted_train(monkeypatch, lambda cfg: KeyboardInterrupt())
    assert main(["train", "--output", str(out)]) == 130
    err = capsys.readouterr().err
    assert "--resume" not in err and "before its first checkpoint" in err and "run the same command again" in err
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"")
    assert main(["train", "--output", str(out)]) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1].split()
    assert last == ["prismdp", "train", "--output", str(out), "--resume"]


# ---------------------------------------------------------------- 7: the Trainer's large-delta message


def test_trainer_names_its_own_argument_to_accept_a_large_delta(tiny_bert_dir, tmp_path):
    """Finding 7: PrivateTrainer with target_delta=0.5 named `--allow-large-delta (make_private(...))` as the fix."""
    from transformers import TrainingArguments

    from prismdp.data.collate import pad_collate
    from prismdp.integrations.hf import PrivacyArguments, PrivateTrainer
    from prismdp.models import load_model

    model, tok = load_model(tiny_bert_dir, "seq_cls", 2)
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["query"], task_type="SEQ_CLS"))
    rows = [{"input_ids": [1, 5, 2], "labels": i % 2} for i in range(40)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[],
                             save_strategy="no", remove_unused_columns=False, use_cpu=True, disable_tqdm=True)
    with pytest.raises(ValueError) as info:
        PrivateTrainer(model=model, args=args, train_dataset=rows,
                       privacy_args=PrivacyArguments(target_epsilon=3.0, expected_batch_size=8, target_delta=0.5),
                       data_collator=functools.partial(pad_collate, pad_token_id=tok.pad_token_id))
    msg = str(info.value)
    assert "PrivacyArguments(allow_large_delta=True)" in msg and "--allow-large-delta" not in msg, msg


# ---------------------------------------------------------------- 9: epsilon's cadence in metrics.jsonl


def test_readme_states_the_epsilon_cadence_of_metrics_jsonl_that_the_loop_writes():
    """Finding 9: README said metrics.jsonl logs "per step: loss, epsilon spent, ..." while epsilon is null on all but
    8 steps (each new step count costs a PRV call, ~0.1-0.3 s).  The README now states the loop's cadence."""
    from prismdp.privacy import report_steps

    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "per step: loss, epsilon spent" not in readme
    assert re.search(r"epsilon spent at 8 evenly spaced steps \(the last included; null on the others", readme)
    assert len(report_steps(300)) == 8 and 300 in report_steps(300)


# ---------------------------------------------------------------- 10: refusals before the weights are loaded


@pytest.mark.parametrize("change, message", [
    (dict(delta=0.5), r"delta=0.5 is not below 1/N = 1/96"),
    (dict(target_modules=["query", "qeury"]), r"\['qeury'\] name no module of this model"),
])
def test_delta_and_target_refusals_come_before_the_model_is_loaded(tiny_bert_dir, tmp_path, monkeypatch, change,
                                                                   message):
    """Finding 10: a delta at or above 1/N and a misspelt LoRA target were refused only after the model had loaded
    (minutes on an 8B model).  The data is read with the tokenizer alone and the targets are checked on a meta-device
    model built from the configuration: load_model is never reached."""
    import prismdp.train.build as build
    from prismdp.train.config import TrainConfig

    def no_load(*a, **k):
        raise AssertionError("the model's weights were loaded before the refusal")

    monkeypatch.setattr(build, "load_model", no_load)
    cfg = TrainConfig(model=tiny_bert_dir, task="synthetic", synthetic_train=96, synthetic_test=16, steps=2,
                      batch_size=16, rank=2, max_length=16, output=str(tmp_path / "run"), **change)
    with pytest.raises(ValueError, match=message):
        build.build_run(cfg, log=lambda *a: None)


def test_the_meta_skeleton_has_the_loaded_models_module_names(tiny_bert_dir, tiny_llama_dir):
    """The early target check sees the modules the real model has (names and linear layers), and reads no weights."""
    import torch

    from prismdp.models import load_model, model_skeleton

    for path, task, labels in ((tiny_bert_dir, "seq_cls", 2), (tiny_llama_dir, "causal_lm", None)):
        skeleton = model_skeleton(path, task, labels)
        model, _ = load_model(path, task, labels)
        assert [n for n, _ in skeleton.named_modules()] == [n for n, _ in model.named_modules()]
        assert all(p.device == torch.device("meta") for p in skeleton.parameters())
