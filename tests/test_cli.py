"""`prismdp train` / `prismdp epsilon` end to end on tiny models."""

import json
import shlex
import signal
import sys

import pytest
import torch

from helpers import Spawned, interrupt_when_logged
from prismdp.cli import main
from prismdp.engine import METHODS
from prismdp.privacy import calibrate_sigma, epsilon
from prismdp.train.config import ConfigError, TrainConfig
from prismdp.train.loop import RunExistsError, train


def tiny_cfg(model_dir, out, **kw):
    base = dict(model=model_dir, task="synthetic", synthetic_train=96, synthetic_test=32, steps=4, batch_size=16,
                micro_batch_size=8, rank=4, alpha=8, lr=5e-3, max_length=32, output=str(out), epsilon=3.0)
    base.update(kw)
    return TrainConfig(**base)


def test_epsilon_command_matches_the_library(capsys):
    assert main(["epsilon", "--sigma", "1.1", "--sample-rate", "0.02", "--steps", "300", "--delta", "1e-5"]) == 0
    assert float(capsys.readouterr().out) == pytest.approx(epsilon(1.1, 0.02, 300, 1e-5), rel=1e-5)
    assert main(["epsilon", "--target-epsilon", "3", "--sample-rate", "0.02", "--steps", "300",
                 "--accountant", "rdp"]) == 0
    sigma = float(capsys.readouterr().out)
    assert sigma == pytest.approx(calibrate_sigma(3.0, 1e-5, 0.02, 300, accountant="rdp"), rel=1e-5)
    assert epsilon(sigma, 0.02, 300, 1e-5, accountant="rdp") <= 3.0
    assert main(["epsilon", "--sigma", "2", "--sample-rate", "0.1", "--steps", "500", "--delta", "1e-6",
                 "--accountant", "pld"]) == 0
    assert float(capsys.readouterr().out) == pytest.approx(epsilon(2.0, 0.1, 500, 1e-6, "pld"), rel=1e-5)
    assert main(["epsilon", "--sigma", "0.05", "--sample-rate", "0.5", "--steps", "100", "--accountant", "rdp"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == "inf" and "not trusted" in out.err
    assert main(["epsilon", "--target-epsilon", "1000", "--sample-rate", "0.02", "--steps", "300"]) == 2
    assert "above 100" in capsys.readouterr().err


def test_a_command_prints_nothing_but_its_answer():
    """In a fresh interpreter (the optional backends imported as a user's shell would import them): stdout the epsilon,
    stderr empty. bitsandbytes' CPU backend (peft imports it) warned on every command, on CPUs with AVX512-BF16, that
    it could not fetch an optional kernel from the Hub; torchao warned for each CUDA kernel a CPU build lacks."""
    import subprocess

    r = subprocess.run([sys.executable, "-m", "prismdp", "epsilon", "--sigma", "1", "--sample-rate", "0.01", "--steps",
                        "10"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "" and float(r.stdout) == pytest.approx(epsilon(1.0, 0.01, 10, 1e-5),
                                                                                     rel=1e-5)


def test_epsilon_command_refuses_a_delta_that_makes_the_guarantee_vacuous(capsys):
    """At delta 0.5 Opacus' PRV gives epsilon -0.68 for this run (and cannot compute one at all for others): an error
    naming delta, exit 2, nothing on stdout.  With --dataset-size, a delta >= 1/N is refused as in training."""
    common = ["epsilon", "--sigma", "1", "--sample-rate", "0.08", "--steps", "12"]
    assert main([*common, "--delta", "0.5"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "delta=0.5 is too large" in err and "epsilon -0.682" in err
    assert main([*common, "--delta", "0.01", "--dataset-size", "200"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "not below 1/N = 1/200" in err and "--allow-large-delta" in err
    assert main([*common, "--delta", "0.01", "--dataset-size", "200", "--allow-large-delta"]) == 0
    assert float(capsys.readouterr().out) == pytest.approx(epsilon(1.0, 0.08, 12, 0.01), rel=1e-5)


def test_train_refuses_delta_at_or_above_one_over_n_before_writing_anything(tiny_bert_dir, tmp_path, capsys):
    """96 training examples: delta 0.05 >= 1/96 is refused (no run folder) unless --allow-large-delta, which trains
    and records that delta; delta 0.5 (allowed) is refused with the reason instead of an Opacus traceback."""
    common = ["train", "--model", tiny_bert_dir, "--synthetic-train", "96", "--synthetic-test", "16", "--steps", "2",
              "--batch-size", "16", "--rank", "2", "--max-length", "16", "--quiet"]
    assert main([*common, "--delta", "0.05", "--output", str(tmp_path / "a")]) == 2
    assert "not below 1/N = 1/96" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert main([*common, "--delta", "0.5", "--allow-large-delta", "--output", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "delta=0.5 is too large" in err and "Traceback" not in err and not (tmp_path / "b").exists()
    assert main([*common, "--delta", "0.05", "--allow-large-delta", "--output", str(tmp_path / "c")]) == 0
    assert json.loads((tmp_path / "c" / "privacy.json").read_text())["delta"] == 0.05


@pytest.mark.parametrize("method, start", [("prism", "method"), ("dp-adamw", "method"), ("dp-adamw", "rank-r")])
def test_train_writes_a_stock_peft_adapter_that_reproduces_the_model(tiny_bert_dir, tmp_path, method, start):
    """Also DP-AdamW from PRISM's rank-r start (--start rank-r): its export must subtract Z0 as PRISM's does."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "run"
    res = train(tiny_cfg(tiny_bert_dir, out, method=method, start=start, dropout=0.1), progress=False,
                log=lambda *a: None)
    started = method == "prism" or start == "rank-r"
    for name in ("config.json", "metrics.jsonl", "privacy.json", "eval.json", "checkpoint.pt",
                 "adapter/adapter_config.json", "adapter/adapter_model.safetensors"):
        assert (out / name).is_file(), name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(k in records[0] for k in ("loss", "epsilon", "clip_fraction", "step_time_s"))
    assert records[-1]["epsilon"] == pytest.approx(json.loads((out / "privacy.json").read_text())["epsilon"])

    # a stock PEFT load on the ORIGINAL base model reproduces the trained model's logits
    base = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=2)
    loaded = PeftModel.from_pretrained(base, out / "adapter").eval()
    res.model.eval()
    ids = torch.randint(1000, 5000, (3, 12))
    with torch.no_grad():
        diff = (loaded(input_ids=ids).logits - res.model(input_ids=ids).logits).abs().max().item()
    assert diff < 1e-4
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == (8 if started else 4)  # a rank-r start exports Z - Z0 at rank 2r


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_causal_lm_adapter_loads_with_stock_peft_and_reproduces_the_logits(tiny_llama_dir, tmp_path, method):
    """A tiny Llama trained by prismdp train (instruction task, LoRA dropout 0.1, private): its exported adapter, loaded
    with stock PEFT on the original base model, reproduces the trained model's logits (float32); PRISM exports its
    update at rank 2r."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    records = [{"instruction": f"Add {i} and {i + 1}.", "input": "", "output": f"The answer is {2 * i + 1}."}
               for i in range(32)]
    (tmp_path / "data.json").write_text(json.dumps(records))
    out = tmp_path / "run"
    res = train(tiny_cfg(tiny_llama_dir, out, task="instruct", data=str(tmp_path / "data.json"), method=method,
                         steps=3, batch_size=8, micro_batch_size=4, max_length=48, rank=4, alpha=8, lr=2e-2,
                         dropout=0.1, epsilon=8.0), **QUIET)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    loaded = PeftModel.from_pretrained(base, out / "adapter").eval()
    res.model.eval()
    ids = torch.randint(5, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = loaded(input_ids=ids).logits, res.model(input_ids=ids).logits
        with loaded.disable_adapter():
            plain = loaded(input_ids=ids).logits
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
    assert float((plain - want).abs().max()) > 1e-3  # the adapter carries a real update
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == (8 if method == "prism" else 4)
    assert sorted(cfg["target_modules"]) == ["down_proj", "k_proj", "q_proj", "up_proj", "v_proj"]


def test_privacy_report_agrees_with_epsilon_command(tiny_bert_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--model", tiny_bert_dir, "--steps", "3", "--batch-size", "16", "--micro-batch-size", "8",
                 "--rank", "4", "--max-length", "32", "--output", str(out), "--quiet", "--epsilon", "2",
                 "--seed", "1"]) == 0
    rep = json.loads((out / "privacy.json").read_text())
    for key in ("epsilon", "delta", "noise_multiplier", "sample_rate", "steps", "dataset_size", "accountant",
                "max_grad_norm", "method"):
        assert key in rep
    assert rep["steps"] == 3 and rep["method"] == "prism" and rep["epsilon"] <= 2.0
    capsys.readouterr()
    main(["epsilon", "--sigma", str(rep["noise_multiplier"]), "--sample-rate", str(rep["sample_rate"]),
          "--steps", "3", "--delta", str(rep["delta"])])
    assert float(capsys.readouterr().out) == pytest.approx(rep["epsilon"], rel=1e-5)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_interrupted_then_resumed_equals_uninterrupted(tiny_bert_dir, tmp_path, method):
    """Every method, through prismdp train's checkpoint file: stopped after 3 of 6 steps and resumed, the run ends
    where the uninterrupted one ends, to 1e-6 (optimizer state, noise and sampling streams, dropout RNG restored)."""
    from safetensors.torch import load_file

    quiet = dict(progress=False, log=lambda *a: None)
    kw = dict(steps=6, dropout=0.1, method=method, synthetic_train=64, batch_size=8, rank=2)
    full = tmp_path / "full"
    train(tiny_cfg(tiny_bert_dir, full, **kw), **quiet)
    part = tmp_path / "part"
    res = train(tiny_cfg(tiny_bert_dir, part, **kw), stop_after=3, **quiet)
    assert res.summary == {"interrupted_at": 3}
    assert not (part / "privacy.json").exists()
    with pytest.raises(RunExistsError):
        train(tiny_cfg(tiny_bert_dir, part, **kw), **quiet)
    with pytest.raises(ConfigError, match="steps"):
        train(tiny_cfg(tiny_bert_dir, part, **{**kw, "steps": 7}), resume=True, **quiet)
    train(tiny_cfg(tiny_bert_dir, part, **kw), resume=True, **quiet)
    assert json.loads((part / "privacy.json").read_text()) == json.loads((full / "privacy.json").read_text())
    a = load_file(full / "adapter" / "adapter_model.safetensors")
    b = load_file(part / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    lines = (part / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, 7))


QUIET = dict(progress=False, log=lambda *a: None)


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _adapter(folder):
    from safetensors.torch import load_file

    return load_file(folder / "adapter" / "adapter_model.safetensors")


def _same_adapter(a, b):
    a, b = _adapter(a), _adapter(b)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_a_refused_resume_changes_no_file_and_the_data_must_be_the_runs(tiny_bert_dir, tmp_path):
    """The training file grew (40 -> 50 rows: was refused only after config.json had been overwritten), or was swapped
    for other rows of the same count (was resumed silently): refused, every file of the run unchanged.  --lr equal to
    the run's default (was refused as 'checkpoint None vs now 0.0002') resumes; another rate is refused."""
    rows = [f"sentence number {i}" for i in range(60)]
    data = tmp_path / "glue"
    out = tmp_path / "run"
    cfg = dict(task="sst2", data=str(data), lr=None, steps=4, batch_size=8)
    _sst2(data, rows[:40])
    assert train(tiny_cfg(tiny_bert_dir, out, **cfg), stop_after=2, **QUIET).summary == {"interrupted_at": 2}
    before = _files(out)
    assert set(before) == {"config.json", "metrics.jsonl", "checkpoint.pt"}
    fingerprint = json.loads(before["config.json"])["data_fingerprint"]
    for changed, match in [(rows[:50], r"40 training examples then, 50 now"),
                           (rows[20:60], r"as many examples \(40\) but different content")]:
        _sst2(data, changed)
        with pytest.raises(ConfigError, match=f"training data changed since the checkpoint \\({match}; SHA-256 of "
                                              f"the tokenised data {fingerprint[:12]}"):
            train(tiny_cfg(tiny_bert_dir, out, **cfg), resume=True, **QUIET)
        assert _files(out) == before
    _sst2(data, rows[:40])
    with pytest.raises(ConfigError, match=r"lr: checkpoint 0.0002 vs now 0.0003"):
        train(tiny_cfg(tiny_bert_dir, out, **{**cfg, "lr": 3e-4}), resume=True, **QUIET)
    assert _files(out) == before
    res = train(tiny_cfg(tiny_bert_dir, out, **{**cfg, "lr": 2e-4}), resume=True, **QUIET)  # the default, resolved
    assert res.summary["steps"] == 4


def test_a_run_stopped_before_its_first_checkpoint_restarts_with_resume(tiny_bert_dir, tmp_path):
    """Killed before its first checkpoint, a run leaves config.json and metrics.jsonl: starting it again is refused
    (pointing to --resume), and --resume (which pointed back to 'start without --resume') restarts it from step 0 and
    ends where an uninterrupted run ends."""
    full, part = tmp_path / "full", tmp_path / "part"
    train(tiny_cfg(tiny_bert_dir, full, steps=4, dropout=0.1), **QUIET)
    train(tiny_cfg(tiny_bert_dir, part, steps=4, dropout=0.1), stop_after=2, **QUIET)
    (part / "checkpoint.pt").unlink()  # the folder a kill before the first checkpoint leaves
    with pytest.raises(RunExistsError, match=r"stopped before its first checkpoint \(2 step\(s\) logged, none saved\); "
                                             r"pass --resume to restart it from step 0"):
        train(tiny_cfg(tiny_bert_dir, part, steps=4, dropout=0.1), **QUIET)
    logs = []
    train(tiny_cfg(tiny_bert_dir, part, steps=4, dropout=0.1), resume=True, progress=False, log=logs.append)
    assert any("no checkpoint" in line and "starting the run from step 0" in line for line in logs)
    _same_adapter(full, part)
    assert [json.loads(x)["step"] for x in (part / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    train(tiny_cfg(tiny_bert_dir, tmp_path / "new", steps=1), resume=True, **QUIET)  # --resume with no run: fresh


def test_a_damaged_checkpoint_or_metrics_log_is_a_clear_error(tiny_bert_dir, tmp_path, capsys):
    """A truncated checkpoint.pt (was a bare OSError traceback) and a bad line in metrics.jsonl (was a JSON parser error
    naming no file): errors naming the file and the fix.  A half-written last line (a kill during its write) is
    dropped and its step redone."""
    out = tmp_path / "run"
    args = ["train", "--model", tiny_bert_dir, "--synthetic-train", "64", "--synthetic-test", "16", "--steps", "4",
            "--batch-size", "8", "--rank", "2", "--max-length", "16", "--quiet", "--output", str(out)]
    assert main([*args, "--stop-after", "2"]) == 0
    ckpt = (out / "checkpoint.pt").read_bytes()
    (out / "checkpoint.pt").write_bytes(ckpt[:5000])
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'checkpoint.pt'} cannot be read" in err and "truncated or damaged" in err
    assert "pass --resume to restart the run from step 0" in err and "Traceback" not in err
    (out / "checkpoint.pt").write_bytes(ckpt)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1][:20] + "\n")
    assert main([*args, "--resume"]) == 2
    assert f"{out / 'metrics.jsonl'}:2: not a metrics record" in capsys.readouterr().err
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 3, "loss": 0.')  # cut short
    assert main([*args, "--resume"]) == 0
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_a_failed_run_removes_what_it_created_and_nothing_else(tiny_bert_dir, tmp_path):
    """A failure during training before the first checkpoint (here: a tokenizer whose ids exceed the model's
    vocabulary) removes the run's config.json and metrics.jsonl, and the folder if the run created it; a file of the
    user's in the folder stays.  A config.json prismdp did not write is never overwritten."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    small = tmp_path / "small_vocab"
    BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32)).save_pretrained(small)
    AutoTokenizer.from_pretrained(tiny_bert_dir).save_pretrained(small)
    with pytest.raises(IndexError):
        train(tiny_cfg(str(small), tmp_path / "new", steps=2, rank=2), **QUIET)
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    with pytest.raises(IndexError):
        train(tiny_cfg(str(small), mine, steps=2, rank=2), **QUIET)
    assert _files(mine) == {"notes.txt": b"my notes"}
    (mine / "config.json").write_text('{"architectures": ["BertModel"]}')
    with pytest.raises(RunExistsError, match="config.json exists and was not written by prismdp train"):
        train(tiny_cfg(tiny_bert_dir, mine, steps=1), **QUIET)
    assert (mine / "config.json").read_text() == '{"architectures": ["BertModel"]}'


def test_ctrl_c_finishes_the_step_saves_a_checkpoint_and_the_run_resumes_exactly(tiny_bert_dir, tmp_path):
    """SIGINT in the middle of a run (was: a KeyboardInterrupt traceback, and the steps since the last checkpoint
    lost): the step under way is finished, a checkpoint saved at it (checkpoint_every 100 never fires), and the resumed
    run ends bitwise where an uninterrupted one ends."""
    from prismdp.train.interrupt import TrainingInterrupted

    kw = dict(steps=20, batch_size=8, synthetic_train=64, rank=2, dropout=0.1, checkpoint_every=100)
    full, part = tmp_path / "full", tmp_path / "part"
    train(tiny_cfg(tiny_bert_dir, full, **kw), **QUIET)
    previous = signal.signal(signal.SIGINT, lambda *a: None)  # a signal arriving after the run must not stop pytest
    try:
        watcher = interrupt_when_logged(part / "metrics.jsonl", 2)
        with pytest.raises(TrainingInterrupted) as info:
            train(tiny_cfg(tiny_bert_dir, part, **kw), **QUIET)
        watcher.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    stopped = info.value.step
    assert 2 <= stopped < 20 and info.value.signame == "SIGINT" and isinstance(info.value, KeyboardInterrupt)
    assert torch.load(part / "checkpoint.pt", weights_only=False)["step"] == stopped
    assert len((part / "metrics.jsonl").read_text().splitlines()) == stopped
    assert signal.getsignal(signal.SIGINT) is previous  # the handler is restored
    train(tiny_cfg(tiny_bert_dir, part, **kw), resume=True, **QUIET)
    _same_adapter(full, part)
    assert json.loads((part / "privacy.json").read_text()) == json.loads((full / "privacy.json").read_text())


def test_ctrl_c_on_the_command_line_prints_the_resume_command_and_no_traceback(tiny_bert_dir, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--model", tiny_bert_dir, "--synthetic-train", "64", "--synthetic-test", "16", "--steps", "20",
            "--batch-size", "8", "--rank", "2", "--max-length", "16", "--quiet", "--output", str(out)]
    with Spawned([[sys.executable, "-m", "prismdp", *args]], tmp_path / "logs") as run:  # bounded, nothing left
        interrupt_when_logged(out / "metrics.jsonl", 2, pid=run.procs[0].pid)
        done = run.wait(600)[0]
    err = done.stderr
    assert done.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "stopped after step" in err and "(SIGINT)" in err, err[-2000:]
    again = shlex.split(err.strip().splitlines()[-1])
    assert again[0] == "prismdp" and again[1:] == [*args, "--resume"]
    steps = torch.load(out / "checkpoint.pt", weights_only=False)["step"]
    assert f"stopped after step {steps} of 20 (SIGINT); checkpoint saved in {out}" in err
    assert main(again[1:]) == 0  # the printed command continues the run
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == list(range(1, 21))


def test_config_file_and_flag_precedence(tiny_bert_dir, tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"model: {tiny_bert_dir}\nsteps: 2\nrank: 4\nbatch-size: 16\nmax_length: 32\n"
                        f"synthetic_train: 64\nsynthetic_test: 16\noutput: {tmp_path / 'r'}\nlr: 0.001\n")
    assert main(["train", "--config", str(cfg_file), "--steps", "3", "--quiet"]) == 0
    resolved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert resolved["steps"] == 3 and resolved["rank"] == 4 and resolved["lr"] == 0.001
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"stepz": 3}))
    assert main(["train", "--config", str(bad)]) == 2


def test_no_dp_run(tiny_bert_dir, tmp_path):
    res = train(tiny_cfg(tiny_bert_dir, tmp_path / "r", dp=False), progress=False, log=lambda *a: None)
    rep = json.loads((tmp_path / "r" / "privacy.json").read_text())
    assert rep["private"] is False
    assert "test" in res.summary["eval"]


def test_glue_tsv_run_and_bad_files(tiny_bert_dir, tmp_path, shared_data):
    res = train(tiny_cfg(tiny_bert_dir, tmp_path / "g", task="sst2", data=str(shared_data / "glue"),
                         train_examples=64, eval_examples=40), progress=False, log=lambda *a: None)
    ev = res.summary["eval"]["validation"]
    assert ev["n"] == 40 and "accuracy" in ev and "score" in ev
    # bad data: wrong columns, labels outside the task's set, empty file -> clear errors before training
    for content, match in [("text\tlabel\nhello\t1\n", "column"), ("sentence\tlabel\nhello\t7\n", "label"),
                           ("sentence\tlabel\n", "empty|no ")]:
        d = tmp_path / "bad" / "SST-2"
        d.mkdir(parents=True, exist_ok=True)
        (d / "train.tsv").write_text(content)
        (d / "dev.tsv").write_text("sentence\tlabel\nfine\t1\n")
        with pytest.raises(ValueError, match=match):
            train(tiny_cfg(tiny_bert_dir, tmp_path / f"b{len(content)}", task="sst2", data=str(tmp_path / "bad")),
                  progress=False, log=lambda *a: None)
    assert main(["train", "--model", tiny_bert_dir, "--task", "sst2", "--data", str(tmp_path / "nowhere"),
                 "--output", str(tmp_path / "x"), "--quiet"]) == 2


def test_config_booleans_are_strict(tmp_path, capsys):
    """dp: "no" (a quoted string) was accepted as truthy; YAML's unquoted no is a boolean and fine."""
    with pytest.raises(ConfigError, match=r"dp: must be true or false .*got 'no'"):
        TrainConfig.from_dict({"dp": "no"})
    with pytest.raises(ConfigError, match="gradient_checkpointing: must be true or false"):
        TrainConfig.from_dict({"gradient_checkpointing": 1})
    (tmp_path / "c.yaml").write_text('dp: "no"\n')
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--output", str(tmp_path / "r")]) == 2
    assert "dp: must be true or false" in capsys.readouterr().err
    (tmp_path / "c.yaml").write_text("dp: no\ntrain_on_inputs: yes\n")
    from prismdp.train.config import load_config_file

    cfg = TrainConfig.from_dict(load_config_file(tmp_path / "c.yaml"))
    assert cfg.dp is False and cfg.train_on_inputs is True


def _sst2(folder, sentences, labels=None):
    d = folder / "SST-2"
    d.mkdir(parents=True, exist_ok=True)
    labels = labels or [i % 2 for i in range(len(sentences))]
    (d / "train.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in zip(sentences, labels)))
    (d / "dev.tsv").write_text("sentence\tlabel\ngood\t1\nbad\t0\n")
    return str(folder)


def test_bad_settings_found_after_the_model_loads_leave_no_run_folder(tiny_bert_dir, tmp_path, capsys):
    """An unknown method (was reported as a missing learning rate), a misspelled LoRA target next to a correct one
    (was ignored: fewer layers trained), examples longer than the model's position embeddings (was a shape error in
    the first forward, leaving config.json and an empty metrics.jsonl that blocked a rerun): clear errors, exit 2, no
    run folder."""
    data = _sst2(tmp_path / "glue", [f"sentence number {i}" for i in range(40)])
    common = ["train", "--model", tiny_bert_dir, "--task", "sst2", "--data", data, "--steps", "2", "--batch-size", "8",
              "--rank", "2", "--max-length", "32", "--quiet"]
    cases = [(["--method", "adam"], f"method: unknown method 'adam'; choose one of {', '.join(METHODS)}"),
             (["--target-modules", "query,valeu"], r"target_modules: ['valeu'] name no module of this model; pass "
                                                   "--target-modules with names of its linear layers: classifier, "
                                                   "dense, key, query, value")]
    for i, (extra, message) in enumerate(cases):
        assert main([*common, *extra, "--output", str(tmp_path / f"r{i}")]) == 2
        err = capsys.readouterr().err
        assert message in err and "learning rate" not in err and not (tmp_path / f"r{i}").exists()
    long = _sst2(tmp_path / "long", [" ".join(["word"] * 200)] * 20)
    args = [a if a != data else long for a in common]
    assert main([*args, "--max-length", "300", "--output", str(tmp_path / "long_run")]) == 2
    assert "examples of 202 tokens, but this model has position embeddings for 128; pass --max-length 128" in \
        capsys.readouterr().err
    assert not (tmp_path / "long_run").exists()


def test_blank_sentences_are_counted_and_reported(tiny_bert_dir, tmp_path):
    data = _sst2(tmp_path / "glue", [f"sentence {i}" for i in range(30)] + ["", "   "])
    logs = []
    train(tiny_cfg(tiny_bert_dir, tmp_path / "r", task="sst2", data=data, steps=1, batch_size=8), progress=False,
          log=logs.append)
    assert json.loads((tmp_path / "r" / "config.json").read_text())["data_notes"]["blank"] == 2
    assert any("blank: 2 example(s) with an empty sentence" in line for line in logs)


def test_config_file_errors_name_the_file(tmp_path, capsys):
    (tmp_path / "run.yaml").mkdir()
    assert main(["train", "--config", str(tmp_path / "run.yaml")]) == 2
    assert "run.yaml is a folder" in capsys.readouterr().err
    (tmp_path / "latin.yaml").write_bytes(b"steps: 3\n# r\xe9sum\xe9\n")
    assert main(["train", "--config", str(tmp_path / "latin.yaml")]) == 2
    assert "latin.yaml:2: byte 0xe9 at column 4 is not UTF-8" in capsys.readouterr().err


def test_instruct_run_counts_truncation(tiny_llama_dir, tmp_path, shared_data):
    logs = []
    res = train(tiny_cfg(tiny_llama_dir, tmp_path / "i", task="instruct", data=str(shared_data / "math" / "math_10k.json"),
                         train_examples=24, max_length=128, batch_size=8, micro_batch_size=4, steps=2),
                progress=False, log=logs.append)
    notes = json.loads((tmp_path / "i" / "config.json").read_text())["data_notes"]
    assert notes["train_examples"] == 24 and notes["truncated"] > 0
    assert any("truncated" in line for line in logs)
    assert res.summary["privacy"]["steps"] == 2
    with pytest.raises(ConfigError, match="--data"):
        train(tiny_cfg(tiny_llama_dir, tmp_path / "j", task="instruct"), progress=False, log=lambda *a: None)


def test_epsilon_is_shown_at_eight_steps_and_equals_the_accountant_there(tiny_bert_dir, tmp_path, monkeypatch):
    """No accountant call on the step path: after calibration a 20-step run evaluates epsilon at its 8 report steps
    only, and each shown value is Opacus' own PRV epsilon at that step."""
    from opacus.accountants import PRVAccountant

    import prismdp.privacy.accounting as accounting

    calls = []
    original = accounting._answer.__wrapped__

    def counting(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(accounting, "_answer", accounting.lru_cache(maxsize=4096)(counting))
    out = tmp_path / "run"
    train(tiny_cfg(tiny_bert_dir, out, steps=20, batch_size=8), progress=False, log=lambda *a: None)
    resolved = json.loads((out / "config.json").read_text())
    sigma, q = resolved["noise_multiplier"], resolved["sample_rate"]
    after_calibration = [c for c in calls if c[0] == sigma]  # calibration tries other sigmas first
    assert len({c[2] for c in after_calibration}) <= 9  # the checked run length and the 8 report steps
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shown = {r["step"]: r["epsilon"] for r in records if r["epsilon"] is not None}
    assert set(shown) == {3, 5, 8, 10, 13, 15, 18, 20}
    for step, eps in shown.items():
        acc = PRVAccountant()
        acc.history = [(sigma, q, step)]
        assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def test_every_config_field_is_a_train_flag():
    import argparse
    import dataclasses

    from prismdp.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    dests = {a.dest for a in sub._actions}
    assert {f.name for f in dataclasses.fields(TrainConfig)} <= dests
    args = parser.parse_args(["train", "--no-dp", "--method-kwargs", "{preset: reference}", "--target-modules",
                              "q,v", "--holdout-val", "100", "--no-group-by-length", "--accountant", "rdp"])
    assert args.dp is False and args.method_kwargs == {"preset": "reference"} and args.target_modules == ["q", "v"]
    assert args.holdout_val == 100 and args.group_by_length is False and args.accountant == "rdp"
    assert "lr" not in vars(args)  # unset flags stay unset (the config file / defaults fill them)


def test_bf16_checkpointed_run_tracks_float32_and_exports_an_adapter_for_the_original_base(tiny_llama_dir, tmp_path,
                                                                                          shared_data):
    """prismdp train --dtype bfloat16 --gradient-checkpointing (PRISM, private at epsilon 8) follows the float32 run
    of the same seed (per-step training loss within 0.5 %; the loss falls), and a stock PEFT load of its adapter on the
    original bf16 base reproduces the trained model's logits up to bf16 rounding (W0 - Z0 is stored in bf16)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    losses = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        res = train(tiny_cfg(tiny_llama_dir, out, task="instruct", data=str(shared_data / "math" / "math_10k.json"),
                             train_examples=64, max_length=48, batch_size=16, micro_batch_size=8, steps=20, lr=1e-2,
                             train_on_inputs=True, epsilon=8.0, dtype=dtype, rank=4, alpha=4,
                             gradient_checkpointing=dtype == "bfloat16"),
                    progress=False, log=lambda *a: None)
        losses[dtype] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(losses["float32"], losses["bfloat16"]):
        assert b == pytest.approx(a, rel=5e-3)
    assert sum(losses["bfloat16"][-5:]) < sum(losses["bfloat16"][:5]) - 0.05
    assert res.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
    assert res.model.base_model.model.is_gradient_checkpointing
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    loaded = PeftModel.from_pretrained(base, tmp_path / "bfloat16" / "adapter").eval()
    res.model.eval()
    ids = torch.randint(5, 500, (2, 10))
    with torch.no_grad():
        a, b = loaded(input_ids=ids).logits.float(), res.model(input_ids=ids).logits.float()
    assert float((a - b).abs().max()) < 0.02 * float(b.abs().max())


def test_threads_hold_for_the_run_only_and_a_resume_may_change_them(tiny_bert_dir, tmp_path):
    """--threads sets torch's CPU threads while the run computes (seen from its setup hook, before the first step) and
    gives the caller's setting back after it, also after an interrupted run; a resume with another thread count goes on
    (the count changes how the run computes, not what); zero threads are refused."""
    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    seen = []
    out = tmp_path / "run"
    hook = dict(QUIET, setup=lambda run: seen.append(torch.get_num_threads()))
    cfg = dict(steps=4, checkpoint_every=2)
    assert train(tiny_cfg(tiny_bert_dir, out, threads=want, **cfg), stop_after=2, **hook).summary == \
        {"interrupted_at": 2}
    assert seen == [want] and torch.get_num_threads() == before
    assert json.loads((out / "config.json").read_text())["threads"] == want
    res = train(tiny_cfg(tiny_bert_dir, out, **cfg), resume=True, **hook)
    assert seen == [want, before] and torch.get_num_threads() == before and "privacy" in res.summary
    with pytest.raises(ConfigError, match="threads: must be a positive integer or null, got 0"):
        TrainConfig(threads=0)


def test_the_lora_model_is_built_without_a_warning():
    """peft 0.21 reads transformers 5's deprecated ``is_gradient_checkpointing``: a FutureWarning on every run, about
    neither this run nor anything the user can change; with prismdp's filters in place (``prismdp.quiet``, installed by
    the command line and the Python API's entry points) ``build_lora_model`` builds the PEFT model without it. The
    filters are installed after ``simplefilter("error")``, as an entry point installs them after the user's own."""
    import warnings

    from transformers import BertConfig, BertForSequenceClassification

    from prismdp import quiet
    from prismdp.train.build import build_lora_model

    base = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.install()
        model, targets, _ = build_lora_model(TrainConfig(rank=2, alpha=4.0), base, "seq_cls")
    assert targets and any("lora_A" in n for n, _ in model.named_parameters())


def _instruct(path, n_long, n_short):
    """LLM-Adapters records: ``n_long`` whose prompt alone fills 48 tokens (no target token left at --max-length 48),
    ``n_short`` whose answer fits."""
    recs = ([{"instruction": " ".join(["word"] * 80), "input": "", "output": "3"}] * n_long
            + [{"instruction": "Add one and two.", "input": "", "output": "3"}] * n_short)
    path.write_text(json.dumps(recs))
    return str(path)


def test_data_without_a_target_token_is_refused_before_any_budget_is_spent(tiny_llama_dir, tmp_path, capsys):
    """Issue 42, defect 3: every example fully masked (the prompt fills --max-length, the prompt is not trained on):
    the run spent its budget on a loss of 0 and exited 0.  Now exit 2 with one line naming both fixes, and no run
    folder.  Many examples masked (more than 10 %) is warned with the same fixes; a few are only counted."""
    out = tmp_path / "m"
    args = ["train", "--model", tiny_llama_dir, "--task", "instruct", "--steps", "1", "--batch-size", "4",
            "--micro-batch-size", "2", "--max-length", "48", "--rank", "2", "--quiet"]
    assert main([*args, "--data", _instruct(tmp_path / "all.json", 12, 0), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none of the 12 training examples" in err[0]
    assert "--max-length" in err[0] and "--train-on-inputs" in err[0] and not out.exists()
    for n_long, warned in ((3, True), (1, False)):  # 3 of 12 (25 %) warned; 1 of 12 (8 %) counted
        logs = []
        train(tiny_cfg(tiny_llama_dir, tmp_path / f"w{n_long}", task="instruct", max_length=48, batch_size=4,
                       micro_batch_size=2, steps=1, data=_instruct(tmp_path / f"{n_long}.json", n_long, 12 - n_long)),
              progress=False, log=logs.append)
        warning = [line for line in logs if "warning" in line and "no target token" in line]
        assert bool(warning) == warned, logs
        if warned:
            assert f"{n_long} of 12" in warning[0] and "--max-length" in warning[0] and "--train-on-inputs" in warning[0]
