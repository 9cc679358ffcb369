"""Quiet output (issue 42, item 4): on the default job and on 4- and 8-bit runs a user sees prismdp's lines and
progress bars, nothing else; ``--quiet`` leaves only the final lines.  Library messages known to be harmless are
filtered in one place (:mod:`prismdp.quiet`), each narrowly: by logger (or module) and message."""

import logging
import re
import sys
import warnings

import pytest

from helpers import Spawned
from prismdp import quiet

# What prismdp writes on stderr: its progress bars (train, eval <set>), its own lines, and the bar of the model load
# it starts (transformers' weight loading / GGUF de-quantization: minutes on a large model; hidden by --quiet)
OURS = re.compile(r"^(?:train|eval [\w-]+): |^\[prismdp\]|^prismdp |^(?:Loading weights|Converting and de-quantizing "
                  r"GGUF tensors)")


def foreign_lines(stderr: str) -> list[str]:
    """The stderr lines (progress-bar redraws split at carriage returns) that are not prismdp's."""
    return [line for line in re.split(r"[\r\n]+", stderr) if line.strip() and not OURS.match(line.strip())]


def _run(tmp_path, runs: dict[str, list[str]], timeout=400):
    cmds = [[sys.executable, "-m", "prismdp", "train", "--steps", "1", "--batch-size", "16", *argv,
             "--output", str(tmp_path / name)] for name, argv in runs.items()]
    with Spawned(cmds, tmp_path / "logs", names=list(runs)) as group:
        done = group.wait(timeout)
    for name, res in zip(runs, done):
        assert res.returncode == 0, (name, res.stderr[-2000:])
    return dict(zip(runs, done))


def test_the_default_job_writes_only_prismdps_lines_and_quiet_only_the_final_ones(tmp_path):
    """``prismdp train`` on the packaged MiniLM (the default job, small synthetic sizes), in a fresh interpreter: no
    stderr line but prismdp's.  Before: torchao's kernel-loading failures and Triton notice, transformers' 7-line
    LOAD REPORT for the head prismdp adds (11 lines in all here); with ``--quiet`` stderr is empty (before: the
    weight-loading bar and the report) and stdout holds the final lines only."""
    small = ["--synthetic-train", "64", "--synthetic-test", "16"]
    res = _run(tmp_path, {"default": small, "quiet": [*small, "--quiet"]})
    assert foreign_lines(res["default"].stderr) == []
    assert "train: 100%" in res["default"].stderr  # the bars are still there
    assert res["quiet"].stderr == ""
    out = res["quiet"].stdout.strip().splitlines()
    assert len(out) == 2 and out[0].startswith("test accuracy") and out[1].startswith("adapter, metrics")


def test_4bit_and_8bit_runs_write_only_prismdps_lines(tiny_bert_dir, tmp_path):
    """``--quantize 4bit`` and ``8bit`` (a tiny BERT folder): LLM.int8 logged ``MatMul8bitLt: inputs will be cast
    from torch.float32 to float16`` at every layer call (3,360 lines in a two-example evaluation of the MiniLM)."""
    small = ["--model", tiny_bert_dir, "--synthetic-train", "32", "--synthetic-test", "8", "--max-length", "32"]
    res = _run(tmp_path, {"q4": [*small, "--quantize", "4bit"], "q8": [*small, "--quantize", "8bit"]})
    assert foreign_lines(res["q4"].stderr) == [] and foreign_lines(res["q8"].stderr) == []


def test_each_filter_drops_its_own_message_only(caplog):
    """Narrow filters: the message each names is dropped from its logger, the same message from another logger and
    another message from the same logger go through; a LOAD REPORT listing anything but a new head is kept."""
    quiet.install()
    quiet.install()  # idempotent
    log = logging.getLogger("bitsandbytes.autograd._functions")
    assert sum(isinstance(f, quiet._Harmless) for f in log.filters) == 1
    with caplog.at_level(logging.WARNING):
        log.warning("MatMul8bitLt: inputs will be cast from %s to float16 during quantization", "torch.float32")
        log.warning("MatMul8bitLt: something else")
        logging.getLogger("another").warning("MatMul8bitLt: inputs will be cast from torch.float32 to float16")
    assert [r.getMessage() for r in caplog.records] == [
        "MatMul8bitLt: something else", "MatMul8bitLt: inputs will be cast from torch.float32 to float16"]
    table = ("BertForSequenceClassification LOAD REPORT from: x\nKey | Status | \n----+----+-\n"
             "classifier.weight | MISSING | \n{}\nNotes:\n- MISSING:\tnewly initialized")
    assert quiet.new_head_report(table.format("classifier.bias   | MISSING | "))
    assert quiet.new_head_report(table.format("classifier.bias | MISMATCH | Reinit due to size mismatch"))
    assert not quiet.new_head_report(table.format("bert.encoder.layer.0.attention.self.query.weight | MISSING | "))
    assert not quiet.new_head_report(table.format("bert.pooler.dense.weight | UNEXPECTED | "))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.install()
        warnings.warn_explicit("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning,
                               "modeling_utils.py", 1, module="transformers.modeling_utils")
        warnings.warn_explicit("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning,
                               "mine.py", 1, module="mine")
    assert [w.filename for w in caught] == ["mine.py"]


@pytest.mark.parametrize("table", [quiet.LOG_FILTERS, quiet.WARNING_FILTERS])
def test_every_filter_says_why(table):
    assert all(len(entry[-1]) > 40 for entry in table)


def test_final_lines_print_no_nan_and_no_bound_that_is_not_there(tmp_path, monkeypatch, capsys):
    """A generation task has no majority class (its line said "majority class nan"); an audit that rejects no noise
    level said "rejected above noise no bound".  Both lines now leave out what does not exist."""
    from types import SimpleNamespace

    import prismdp.audit.run as audit_run
    import prismdp.train.loop as loop
    from prismdp.cli import main

    summary = {"privacy": {"private": True, "epsilon": 2.99, "delta": 1e-5}, "eval": {"gsm8k": {"score": 0.5, "n": 2}}}

    def train(*a, log=print, **k):  # what the run logs: --quiet keeps its warnings only
        log("[prismdp] truncated: 3 example(s) (max_length=64)")
        log("[prismdp] warning: 3 of 12 training examples (25 %) have no target token left")
        return SimpleNamespace(summary=summary)

    monkeypatch.setattr(loop, "train", train)
    assert main(["train", "--quiet", "--output", str(tmp_path / "t")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "[prismdp] warning: 3 of 12 training examples (25 %) have no target token left",
        "gsm8k accuracy 0.5000 (n=2) | epsilon 2.990 (delta 1e-05)", f"adapter, metrics and privacy report in {tmp_path / 't'}"]
    fdp = {"gdp_mu_lower_bound": 0.0, "gdp_eps_lower_bound": 0.0, "mechanism_sigma_upper_bound": None,
           "mechanism_eps_lower_bound": 0.0, "verdict": "consistent"}
    rep = {"canary_kind": "gradient", "correct": 0, "guesses": 0, "m": 10, "eps_lower_bound": 0.0,
           "significance": 0.05, "epsilon": 3.0, "delta": 1e-5, "verdict": "consistent", "runtime_s": 1.0,
           "fdp": fdp, "noise_multiplier": 1.1}
    monkeypatch.setattr(audit_run, "run_audit", lambda *a, **k: rep)
    assert main(["audit", "--canaries", "10", "--quiet", "--output", str(tmp_path / "a")]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert "no noise level of the run's mechanism is rejected (run's noise 1.100): consistent" in line
    assert "no bound" not in line and "inf" not in line
