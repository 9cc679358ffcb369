"""`prismdp experiment`: grid -> runs -> results.csv / Table-2 tables; the paper's Gemma config."""

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml

from prismdp.cli import main
from prismdp.engine import METHODS
from prismdp.experiment import load_experiment, run_experiment, write_results
from prismdp.experiment.grid import Setting
from prismdp.train.config import ConfigError
from test_glue8 import make_fake_glue

torch.set_num_threads(1)
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PAPER = CONFIGS / "paper-gemma3-4b.yaml"
TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]


def tiny_grid(model_dir, out, **extra):
    return {"name": "tiny", "output": str(out),
            "base": {"model": model_dir, "synthetic_train": 64, "synthetic_test": 24, "steps": 2, "batch_size": 16,
                     "micro_batch_size": 16, "rank": 2, "alpha": 4, "max_length": 24, "lr": {"prism": 5e-3,
                                                                                          "dp-adamw": 5e-3}},
            "tasks": {"synthetic": {}}, "methods": ["dp-adamw", "prism"], "privacy": ["non-dp", 3], "seeds": [7],
            **extra}


def test_tiny_grid_end_to_end_then_skips_done_cells(tiny_bert_dir, tmp_path):
    out = tmp_path / "out"
    exp = load_experiment(tiny_grid(tiny_bert_dir, out))
    logs = []
    run = run_experiment(exp, progress=False, log=logs.append)
    ids = ["synthetic__dp-adamw__nondp__seed7", "synthetic__prism__nondp__seed7",
           "synthetic__dp-adamw__eps3__seed7", "synthetic__prism__eps3__seed7"]
    assert run.ran == ids and not run.failures and not run.skipped
    for cid in ids:
        assert (out / cid / "summary.json").is_file()
    rows = list(csv.DictReader(open(out / "results.csv")))
    scores = [r for r in rows if r["metric"] == "score"]
    assert sorted(r["cell_id"] for r in scores) == sorted(ids) and {r["column"] for r in scores} == {"synthetic"}
    dp_rows = [r for r in scores if r["setting"] == "eps3"]
    assert all(0 < float(r["epsilon_spent"]) <= 3.0 and r["steps"] == "2" and float(r["mean_step_time_s"]) > 0
               and float(r["peak_memory_mb"]) > 0 for r in dp_rows)
    train_info = json.loads((out / ids[-1] / "summary.json").read_text())["train"]
    assert train_info["device"] == "cpu" and train_info["timed_steps"] == 2 and train_info["peak_memory_mb"] > 0
    md = (out / "results.md").read_text()
    assert "## Runtime and memory" in md and "| synthetic | ε=3 | PRISM |" in md  # the paper's Table 5 layout
    assert "| Setting | Method | Synthetic | Avg |" in md and "| Non-DP | AdamW |" in md and "| ε=3 | AdamW |" in md
    assert md.count("**") >= 4  # a best value per column and setting is bold
    tex = (out / "results.tex").read_text()
    assert "\\multirow{2}{*}{$\\varepsilon=3$}" in tex and "\\toprule" in tex and "PRISM" in tex
    assert json.loads((out / "experiment.json").read_text())["cells"][ids[0]]["method"] == "dp-adamw"

    # rerun: every cell is done, nothing is trained, the tables are rebuilt identically
    def boom(*a, **k):
        raise AssertionError("a finished cell was retrained")

    before = (out / "results.csv").read_text()
    run2 = run_experiment(exp, progress=False, log=logs.append, train_fn=boom)
    assert run2.skipped == ids and not run2.ran and not run2.failures
    assert (out / "results.csv").read_text() == before
    # a changed setting does not silently reuse old results
    exp3 = load_experiment(tiny_grid(tiny_bert_dir, out), {"steps": 3})
    run3 = run_experiment(exp3, methods=["prism"], settings=[Setting(3.0)], progress=False, log=logs.append,
                          train_fn=boom)
    assert list(run3.failures) == ["synthetic__prism__eps3__seed7"] and "steps" in run3.failures[ids[-1]]
    # where a run happened does not count, and a key that an older prismdp did not write matches its default
    saved = json.loads((out / ids[-1] / "config.json").read_text())
    del saved["pooling"]
    (out / ids[-1] / "config.json").write_text(json.dumps(saved))
    run4 = run_experiment(load_experiment(tiny_grid(tiny_bert_dir, out), {"device": "cpu"}), progress=False,
                          log=logs.append, train_fn=boom)
    assert run4.skipped == ids and not run4.failures
    run5 = run_experiment(load_experiment(tiny_grid(tiny_bert_dir, out), {"pooling": "mean"}), progress=False,
                          log=logs.append, train_fn=boom)
    assert ids[-1] in run5.failures and "pooling" in run5.failures[ids[-1]]


def test_cli_experiment(tiny_bert_dir, tmp_path, capsys):
    cfg = tmp_path / "grid.yaml"
    cfg.write_text(yaml.safe_dump(tiny_grid(tiny_bert_dir, tmp_path / "default")))
    out = tmp_path / "cli"
    assert main(["experiment", str(cfg), "--output", str(out), "--methods", "prism", "--privacy", "non-dp",
                 "--set", "steps=1", "--quiet"]) == 0
    assert (out / "synthetic__prism__nondp__seed7" / "summary.json").is_file()
    assert not (out / "synthetic__dp-adamw__nondp__seed7").exists()
    assert "| Non-DP | PRISM |" in capsys.readouterr().out
    assert main(["experiment", str(cfg), "--output", str(out), "--dry-run", "--set", "steps=1"]) == 0
    printed = capsys.readouterr().out
    assert "done synthetic__prism__nondp__seed7" in printed and "todo synthetic__dp-adamw__eps3__seed7" in printed
    assert main(["experiment", str(cfg), "--methods", "sgd"]) == 2


def _fake_cell(cell, scores, missing=None):
    folder = Path(cell.config.output)
    folder.mkdir(parents=True)
    summary = {"steps": 1, "privacy": {"private": cell.setting.dp, "epsilon": 2.9, "delta": 1e-5},
               "eval": {}, "scores": scores}
    if missing:
        summary["eval_missing"] = missing
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "config.json").write_text(json.dumps(cell.config.to_dict()))


def test_table_mean_std_bold_and_missing_columns(tmp_path):
    exp = load_experiment({"name": "T", "output": str(tmp_path), "tasks": {"glue8": {"task": "glue8"},
                                                                          "math": {"task": "instruct"}},
                           "methods": ["dp-adamw", "prism"], "privacy": [6], "seeds": [1, 2]})
    cells = exp.cells()
    vals = {("glue8", "prism", 1): {"cola": 0.5, "mnli": 0.7}, ("glue8", "prism", 2): {"cola": 0.7, "mnli": 0.7},
            ("math", "prism", 1): {"gsm8k": 0.3}, ("math", "prism", 2): {"gsm8k": 0.5},
            ("glue8", "dp-adamw", 1): {"cola": 0.9, "mnli": 0.1}, ("glue8", "dp-adamw", 2): {"cola": 0.9, "mnli": 0.3}}
    for c in cells:
        if (c.task_id, c.method, c.seed) in vals:
            _fake_cell(c, vals[(c.task_id, c.method, c.seed)], {"qqp": "no QQP validation"} if c.task_id == "glue8"
                       else None)
    _, table = write_results(exp, cells, tmp_path)
    md = (tmp_path / "results.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| Setting"))
    assert header == "| Setting | Method | CoLA | QQP | MNLI | GSM8K | Avg |"
    prism = next(line for line in md.splitlines() if "PRISM" in line)
    adamw = next(line for line in md.splitlines() if "AdamW" in line)
    # mean ± sample std over the two seeds; Avg per seed (0.5, 0.633) then over seeds
    assert "0.600 ± 0.141" in prism and "**0.700 ± 0.000**" in prism and "**0.567 ± 0.094**" in prism
    assert "**0.900 ± 0.000**" in adamw and "| – |" in adamw and "†" in adamw  # AdamW has no math run
    assert "†" not in prism  # QQP is missing for every row: noted under the table, no dagger
    assert "QQP (qqp) not evaluated: no QQP validation" in md and "2 grid cell(s) without results" in md
    tex = (tmp_path / "results.tex").read_text()
    assert "\\multicolumn{3}{c}{\\textbf{GLUE8}}" in tex and "\\multicolumn{1}{c}{\\textbf{Math-10K}}" in tex
    assert "\\textbf{0.700$\\pm$0.000}" in tex and "\\cmidrule(lr){3-5}\\cmidrule(lr){6-6}" in tex
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert len(rows) == 10 and {r["metric"] for r in rows} == {"score"}


def test_grid_validation_errors(tmp_path):
    base = {"tasks": {"synthetic": {}}, "output": str(tmp_path)}
    for bad, match in [({"methods": ["adam"]}, "unknown method"), ({"privacy": ["high"]}, "privacy"),
                       ({"base": {"stepz": 1}}, "unknown key"), ({"base": {"epsilon": 3}}, "set by the grid"),
                       ({"base": {"lr": {"prism": 1e-3}}, "methods": ["prism", "lamb"]}, "lr is a per-method"),
                       ({"tasks": {"a__b": {"task": "sst2"}}}, "id"), ({"tasks": {}}, "at least one task"),
                       ({"colour": 1}, "unknown top-level"), ({"exclude": "*"}, "exclude"),
                       ({"exclude": ["*"]}, "no cell")]:
        with pytest.raises(ConfigError, match=match):
            load_experiment({**base, **bad})


def test_exclude_patterns_leave_cells_out_of_the_grid(tmp_path):
    exp = load_experiment({"tasks": {"synthetic": {}}, "output": str(tmp_path), "seeds": [1, 2],
                           "methods": ["prism", "dp-adamw", "ffa"], "privacy": ["non-dp", 3],
                           "exclude": ["*__ffa__nondp__*", "*__seed2"]})
    ids = [c.id for c in exp.cells()]
    assert ids == ["synthetic__prism__nondp__seed1", "synthetic__dp-adamw__nondp__seed1",
                   "synthetic__prism__eps3__seed1", "synthetic__dp-adamw__eps3__seed1", "synthetic__ffa__eps3__seed1"]


def test_paper_config_round_trips_into_each_cells_train_config():
    exp = load_experiment(PAPER)
    assert list(exp.methods) == ["ffa", "lora-rite", "dp-adamw", "lora-plus", "lamb", "prism"]
    assert set(exp.methods) == set(METHODS)
    assert [s.epsilon for s in exp.settings] == [None, 6.0, 3.0] and exp.seeds == [42]
    cells = exp.cells("runs/x")
    assert len(cells) == 2 * 6 * 3
    for c in cells:
        cfg = c.config
        assert cfg.model == "google/gemma-3-4b-pt"
        assert (cfg.rank, cfg.alpha, cfg.dropout, cfg.target_modules) == (16, 16.0, 0.05, TARGETS)
        assert (cfg.batch_size, cfg.micro_batch_size, cfg.seed) == (64.0, 4, 42)
        assert (cfg.max_grad_norm, cfg.delta) == (1.0, 1e-5)
        assert cfg.accountant == "prv" and cfg.dp == c.setting.dp
        if cfg.dp:
            assert cfg.epsilon == c.setting.epsilon
        family = {"glue8": "glue", "math10k": "math"}[c.task_id]
        assert cfg.lr == METHODS[c.method].lr[family]  # the paper's Appendix B rates
        assert cfg.method_kwargs == ({"loraplus_ratio": 6.0} if c.method == "lora-plus" else {})
        if c.task_id == "glue8":
            assert (cfg.task, cfg.steps, cfg.max_length, cfg.train_on_inputs, cfg.glue8_per_task) == \
                ("glue8", 500, 384, False, 1250)
            assert cfg.data.endswith("shared/data/glue")
        else:
            assert (cfg.task, cfg.steps, cfg.max_length, cfg.train_on_inputs) == ("instruct", 300, 256, True)
            assert cfg.eval_tasks == ["gsm8k", "aqua", "mawps", "svamp"] and cfg.aqua_rule == "first"
            assert cfg.data.endswith("shared/data/math/math_10k.json")
        assert cfg.output == f"runs/x/{c.id}"
    assert len(load_experiment(CONFIGS / "cpu-smollm2-math.yaml").cells()) == 18
    glue = load_experiment(CONFIGS / "cpu-minilm-glue.yaml").cells()  # 6 x {6, 3} x 3 seeds + 2 non-DP x 3 seeds
    assert len(glue) == 4 * (6 * 2 * 3 + 2 * 3)
    assert {c.method for c in glue if not c.setting.dp} == {"prism", "dp-adamw"}
    assert len(load_experiment(CONFIGS / "cpu-minilm-glue-lr.yaml").cells()) == 12


def _tiny_gemma3(tok_vocab, multimodal):
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(vocab_size=tok_vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=24,  # all projections > r = 16
                            max_position_embeddings=512, sliding_window=32, eos_token_id=2, pad_token_id=2,
                            bos_token_id=1)
    if not multimodal:
        return text
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=16,
                        boi_token_index=14, eoi_token_index=15, eos_token_id=2, pad_token_id=2, bos_token_id=1)


def test_gemma3_architecture_gets_the_papers_five_lora_targets():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from prismdp.train.tasks import default_targets, lora_exclude_modules

    targets = yaml.safe_load(PAPER.read_text())["base"]["target_modules"]
    assert targets == TARGETS
    torch.manual_seed(0)
    for multimodal, cls in ((False, "Gemma3ForCausalLM"), (True, "Gemma3ForConditionalGeneration")):
        model = AutoModelForCausalLM.from_config(_tiny_gemma3(300, multimodal))
        assert type(model).__name__ == cls and default_targets(model) == targets
        exclude = lora_exclude_modules(model)
        assert (exclude is None) == (not multimodal)
        peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.05, target_modules=targets,
                                                exclude_modules=exclude))
        wrapped = [n for n, m in peft.named_modules() if hasattr(m, "lora_A") and n.split(".")[-1] in targets]
        assert sorted({n.split(".")[-1] for n in wrapped}) == sorted(targets)
        assert len(wrapped) == 5 * 2 and not any("vision" in n for n in wrapped)  # 5 kinds x 2 decoder layers
    # without the exclusion the vision tower's q/k/v would be LoRA targets too (never run on text inputs)
    plain = get_peft_model(AutoModelForCausalLM.from_config(_tiny_gemma3(300, True)),
                           LoraConfig(r=4, target_modules=targets))
    assert any("vision_tower" in n and hasattr(m, "lora_A") for n, m in plain.named_modules())


def test_paper_cell_trains_a_tiny_multimodal_gemma3_and_resolves_the_papers_config(tiny_llama_dir, tmp_path):
    """One paper cell (GLUE8, PRISM, eps 6), only model/data/steps/eval shrunk, on a random Gemma3 checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    torch.manual_seed(0)
    gemma_dir = tmp_path / "gemma3"
    AutoModelForCausalLM.from_config(_tiny_gemma3(len(tok), True)).save_pretrained(gemma_dir)
    tok.save_pretrained(gemma_dir)
    glue = make_fake_glue(tmp_path / "glue", n_train=8, n_dev=2)
    exp = load_experiment(PAPER, {"model": str(gemma_dir), "data": str(glue), "steps": 1, "glue8_per_task": 8,
                                  "eval_examples": 1, "max_new_tokens": 1})
    run = run_experiment(exp, output=str(tmp_path / "out"), tasks=["glue8"], methods=["prism"],
                         settings=[Setting(6.0)], progress=False, log=lambda *a: None)
    assert not run.failures, run.failures
    cell = tmp_path / "out" / "glue8__prism__eps6__seed42"
    resolved = json.loads((cell / "config.json").read_text())
    expected = {"rank": 16, "alpha": 16.0, "dropout": 0.05, "target_modules": TARGETS, "batch_size": 64.0,
                "micro_batch_size": 4, "max_length": 384, "train_on_inputs": False, "seed": 42, "max_grad_norm": 1.0,
                "delta": 1e-5, "epsilon": 6.0, "dp": True, "lr": 2e-4, "accountant": "prv", "method": "prism",
                "task": "glue8", "glue8_per_task": 8, "dataset_size": 64}
    assert {k: resolved[k] for k in expected} == expected
    assert "vision_tower" in resolved["lora_exclude_modules"]
    summary = json.loads((cell / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] <= 6.0 and set(summary["eval_missing"]) == {"qqp"}
    assert "qqp" in (tmp_path / "out" / "results.md").read_text().lower()


def test_numbers_without_a_dot_are_numbers_not_strings():
    """YAML 1.1 reads 5e-3 as a string; --set and config files must still give a float (or a clear error)."""
    from prismdp.experiment import parse_set_overrides
    from prismdp.train.config import TrainConfig

    assert parse_set_overrides(["lr=5e-3", "head-lr=1e-2", "steps=3"]) == {"lr": 0.005, "head_lr": 0.01, "steps": 3}
    assert TrainConfig.from_dict({"lr": "5e-3", "head_lr": "2e-2"}).lr == 0.005
    with pytest.raises(ConfigError, match="lr must be a number"):
        TrainConfig.from_dict({"lr": "fast"})


def test_task_ids_of_the_same_task_get_their_own_columns(tmp_path):
    # a learning-rate budget: one task under two task ids must not overwrite one column with the other
    exp = load_experiment({"name": "LR", "output": str(tmp_path),
                           "tasks": {"sst2-lr1x": {"task": "sst2", "lr": 1e-3}, "sst2-lr5x": {"task": "sst2", "lr": 5e-3},
                                     "cola": {}},
                           "methods": ["dp-adamw", "prism"], "privacy": [3], "seeds": [0]})
    cells = exp.cells()
    vals = {"sst2-lr1x": 0.61, "sst2-lr5x": 0.65, "cola": 0.2}
    for c in cells:
        _fake_cell(c, {c.config.task: vals[c.task_id] + (0.1 if c.method == "prism" else 0.0)}, None)
    write_results(exp, cells, tmp_path)
    md = (tmp_path / "results.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| Setting"))
    assert header == "| Setting | Method | CoLA | sst2-lr1x | sst2-lr5x | Avg |"
    prism = next(line for line in md.splitlines() if "PRISM" in line)
    assert "**0.710**" in prism and "**0.750**" in prism and "**0.300**" in prism


def test_documented_commands_for_tables_3_to_5_select_the_papers_cells(tmp_path, capsys, monkeypatch):
    """Every `prismdp experiment configs/paper-...` command of configs/README.md parses and selects the paper's
    cells (dry run: no model is loaded)."""
    import shlex

    monkeypatch.chdir(CONFIGS.parent)
    text = (CONFIGS / "README.md").read_text()
    section = text[text.index("### The paper's Tables 3-5"):]
    commands = [ln for ln in section.splitlines() if ln.startswith("prismdp experiment configs/paper-gemma3-4b.yaml")]
    assert len(commands) == 5
    for line in commands:
        argv = shlex.split(line)[1:]
        out = tmp_path / Path(argv[argv.index("--output") + 1]).name
        argv[argv.index("--output") + 1] = str(out)
        assert main(argv + ["--dry-run"]) == 0, line
        listed = [x.split()[-1] for x in capsys.readouterr().out.splitlines() if x.startswith("[experiment] todo")]
        tasks = ["math10k"] if "--tasks" in argv else ["glue8", "math10k"]
        methods = argv[argv.index("--methods") + 1].split(",")
        assert sorted(listed) == sorted(f"{t}__{m}__eps6__seed42" for t in tasks for m in methods), line
    t3 = load_experiment(PAPER, {"model": "google/gemma-2-9b"}).cells(tasks=["math10k"])
    assert {c.config.model for c in t3} == {"google/gemma-2-9b"}
    assert all((c.config.rank, c.config.steps, c.config.max_length) == (16, 300, 256) for c in t3)
    assert {c.config.rank for c in load_experiment(PAPER, {"rank": 8}).cells()} == {8}


def test_gemma2_architecture_gets_the_papers_five_lora_targets():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Gemma2Config

    from prismdp.train.tasks import default_targets

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=48,
                                                          num_hidden_layers=2, num_attention_heads=2,
                                                          num_key_value_heads=1, head_dim=24))
    assert type(model).__name__ == "Gemma2ForCausalLM" and default_targets(model) == TARGETS
    peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=TARGETS))
    wrapped = {n.split(".")[-1] for n, m in peft.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == set(TARGETS)


def test_tuned_grid_widens_at_an_edge_runs_seeds_at_the_chosen_rate_and_reports_pairs(tmp_path):
    """A fake trainer whose validation score peaks at lr 3e-2 for prism (beyond the grid: one widening step) and at
    3e-3 for dp-adamw (inside it); dev scores differ by seed.  Checks the order, the choice, the seeds, the tables."""
    from prismdp.experiment.tuning import next_lr

    assert next_lr([3e-4, 1e-3, 3e-3, 1e-2], "high") == 3e-2 and next_lr([3e-4, 1e-3, 3e-3, 1e-2], "low") == 1e-4
    peak = {"prism": 3e-2, "dp-adamw": 3e-3}
    trained = []

    def fake_train(cfg, resume=False, progress=False, log=None):
        import math

        trained.append(Path(cfg.output).name)
        val = 0.9 - 0.1 * abs(math.log10(cfg.lr / peak[cfg.method]))
        dev = val - 0.01 * (cfg.seed - 1) + (0.05 if cfg.method == "prism" else 0.0)
        folder = Path(cfg.output)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
        (folder / "summary.json").write_text(json.dumps({
            "steps": 1, "privacy": {"private": cfg.dp}, "eval": {"val": {"score": val}, "validation": {"score": dev}},
            "scores": {"sst2": dev}}))

    exp = load_experiment({"name": "T", "output": str(tmp_path), "tasks": {"sst2": {}}, "base": {"holdout_val": 10},
                           "methods": ["dp-adamw", "prism"], "privacy": [3], "seeds": [1, 2, 3],
                           "lrs": [3e-4, 1e-3, 3e-3, 1e-2], "tune": {"by": "val", "widen": 2}})
    run = run_experiment(exp, progress=False, log=lambda *a: None, train_fn=fake_train)
    assert not run.failures
    # the 8 tuning runs first, then prism's widening (3e-2 wins, then 1e-1 loses), then the other seeds
    assert trained[:8] == [f"sst2__{m}__eps3__lr{lr:g}__seed1" for m in ("dp-adamw", "prism")
                           for lr in (3e-4, 1e-3, 3e-3, 1e-2)]
    assert set(trained[8:]) == {"sst2__prism__eps3__lr0.03__seed1", "sst2__prism__eps3__lr0.1__seed1",
                                "sst2__dp-adamw__eps3__lr0.003__seed2", "sst2__dp-adamw__eps3__lr0.003__seed3",
                                "sst2__prism__eps3__lr0.03__seed2", "sst2__prism__eps3__lr0.03__seed3"}
    assert trained.index("sst2__prism__eps3__lr0.1__seed1") < trained.index("sst2__prism__eps3__lr0.03__seed2")
    md = (tmp_path / "results.md").read_text()
    assert "## Learning rates" in md and "| sst2 | ε=3 | PRISM |" in md and "| 0.03 |" in md
    assert "| sst2 | ε=3 | AdamW | 0.050 ± 0.000 | 3/3 |" in md  # paired: +0.05 on every seed
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert {r["lr"] for r in rows if r["method"] == "prism"} == {"0.0003", "0.001", "0.003", "0.01", "0.03", "0.1"}
    # done: a second run trains nothing
    trained.clear()
    run_experiment(exp, progress=False, log=lambda *a: None, train_fn=fake_train)
    assert trained == []


def test_seeds_select_the_runs_at_the_chosen_rate_of_a_tuned_grid(tmp_path):
    """`--seeds 1` on a tuned grid: the tuning runs (seed 1) and nothing at seeds 2 and 3 (they were trained anyway:
    the tuned path ignored --seeds); `--seeds 3` then adds seed 3 alone; a seed not in the grid is refused."""
    exp = load_experiment({"name": "T", "output": str(tmp_path), "tasks": {"sst2": {}}, "base": {"holdout_val": 10},
                           "methods": ["dp-adamw"], "privacy": [3], "seeds": [1, 2, 3], "lrs": [1e-3, 3e-3],
                           "tune": {"by": "val", "widen": 0}})
    trained = []

    def train(cfg, **kw):
        trained.append(Path(cfg.output).name)
        return _train_scoring_lr(cfg, **kw)

    run_experiment(exp, seeds=[1], progress=False, log=lambda *a: None, train_fn=train)
    assert sorted(trained) == [f"sst2__dp-adamw__eps3__lr{lr:g}__seed1" for lr in (0.001, 0.003)]
    trained.clear()
    run_experiment(exp, seeds=[3], progress=False, log=lambda *a: None, train_fn=train)
    assert trained == ["sst2__dp-adamw__eps3__lr0.003__seed3"]
    with pytest.raises(ConfigError, match=r"--seeds: \[7\] not in the experiment"):
        run_experiment(exp, seeds=[7], progress=False, log=lambda *a: None, train_fn=train)


def test_a_cell_claimed_by_a_live_process_is_passed_over(tmp_path):
    import os

    from prismdp.experiment.runner import claim, release

    folder = tmp_path / "cell"
    assert claim(folder) and claim(folder)  # our own claim can be taken again
    (folder / ".claim").write_text(json.dumps({"pid": os.getppid(), "host": __import__("socket").gethostname()}))
    assert not claim(folder)  # a live other process holds it
    (folder / ".claim").write_text(json.dumps({"pid": 2**22 + 12345, "host": __import__("socket").gethostname()}))
    assert claim(folder)  # a dead one's claim is stale
    release(folder)
    assert not (folder / ".claim").exists()


def test_a_method_entry_with_its_own_lrs_is_tuned_on_its_own_ladder(tmp_path):
    """Plain Riemannian SGD needs rates ~100x Adam's: a variant's own `lrs` replaces the grid's for it alone (cells,
    tuning and widening), and `lrs` never reaches its TrainConfig."""
    peak = {"prism": 1e-3, "prism-sgd": 3.0}
    trained = []

    def fake_train(cfg, resume=False, progress=False, log=None):
        import math

        name = Path(cfg.output).name
        trained.append(name)
        val = 0.9 - 0.1 * abs(math.log10(cfg.lr / peak[name.split("__")[1]]))
        folder = Path(cfg.output)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
        (folder / "summary.json").write_text(json.dumps({
            "steps": 1, "privacy": {"private": cfg.dp}, "eval": {"val": {"score": val}, "validation": {"score": val}},
            "scores": {"sst2": val}}))

    exp = load_experiment({"name": "T", "output": str(tmp_path), "tasks": {"sst2": {}}, "base": {"holdout_val": 10},
                           "methods": {"prism": {}, "prism-sgd": {"method": "prism", "method_kwargs": {
                               "adaptive": False}, "lrs": [0.1, 0.3, 1.0]}},
                           "privacy": [3], "seeds": [1, 2], "lrs": [3e-4, 1e-3, 3e-3], "tune": {"by": "val"}})
    assert "lrs" not in exp.methods["prism-sgd"]
    assert sorted(c.lr for c in exp.cells(methods=["prism-sgd"], seeds=[1])) == [0.1, 0.3, 1.0]
    run = run_experiment(exp, progress=False, log=lambda *a: None, train_fn=fake_train)
    assert not run.failures
    sgd = {n for n in trained if "prism-sgd" in n}
    # 1.0 wins at the edge: widened to 3 (wins again), then 10 (loses); seed 2 at 3
    assert sgd == {f"sst2__prism-sgd__eps3__lr{lr:g}__seed1" for lr in (0.1, 0.3, 1, 3, 10)} \
        | {"sst2__prism-sgd__eps3__lr3__seed2"}
    assert {n for n in trained if "__prism__" in n} == {f"sst2__prism__eps3__lr{lr:g}__seed1" for lr in
                                                         (3e-4, 1e-3, 3e-3)} | {"sst2__prism__eps3__lr0.001__seed2"}
    with pytest.raises(ConfigError, match="have their own lrs, but the grid has no"):
        load_experiment({"tasks": {"sst2": {}}, "methods": {"p": {"method": "prism", "lrs": [1.0]}}})


def test_paired_figure_puts_each_seeds_difference_on_its_methods_row(tmp_path):
    """paired.png beside results.md: per task panel, the dots of row (setting, method) are PRISM minus that method on
    each seed, the diamond their mean; rows are labelled setting then method, in the experiment's order."""
    pytest.importorskip("matplotlib")
    from matplotlib.collections import PathCollection

    from prismdp.experiment.figure import paired_figure
    from prismdp.experiment.tables import paired_differences, read_cell

    exp = load_experiment({"name": "T", "output": str(tmp_path), "tasks": {"sst2": {}, "qqp": {}},
                           "methods": ["prism", "dp-adamw", "ffa"], "privacy": [3, "non-dp"], "seeds": [1, 2]})
    cells = exp.cells()
    base = {"prism": 0.80, "dp-adamw": 0.70, "ffa": 0.75}
    for c in cells:
        if c.task_id == "qqp" and c.method == "ffa":
            continue  # no FFA on QQP: its rows stay empty in that panel
        score = base[c.method] + 0.01 * c.seed * (c.method == "prism") + (0.05 if c.setting.dp else 0.0) \
            + (0.1 if c.task_id == "qqp" else 0.0)
        _fake_cell(c, {c.task_id: score})
    write_results(exp, cells, tmp_path)
    assert (tmp_path / "paired.png").stat().st_size > 1000
    pairs = paired_differences(exp, cells, [r for r in (read_cell(c) for c in cells) if r is not None])
    fig = paired_figure(exp, pairs)
    ax_sst2, ax_qqp = fig.axes
    labels = [t.get_text() for t in ax_sst2.get_yticklabels()]
    assert labels == ["ε=3  AdamW", "ε=3  FFA", "Non-DP  AdamW", "Non-DP  FFA"]
    y = {label: ax_sst2.get_yticks()[i] for i, label in enumerate(labels)}
    dots = {}
    for ax, task in ((ax_sst2, "sst2"), (ax_qqp, "qqp")):
        for coll in ax.collections:
            if isinstance(coll, PathCollection):  # the per-seed dots (the means are errorbar lines)
                for x, yy in coll.get_offsets():
                    dots.setdefault((task, round(float(yy))), []).append(round(float(x), 6))
    # PRISM minus AdamW: 0.10 + 0.01 * seed; minus FFA: 0.05 + 0.01 * seed, in both settings
    assert sorted(dots[("sst2", round(y["ε=3  AdamW"]))]) == [0.11, 0.12]
    assert sorted(dots[("sst2", round(y["Non-DP  FFA"]))]) == [0.06, 0.07]
    assert sorted(dots[("qqp", round(y["Non-DP  AdamW"]))]) == [0.11, 0.12]
    assert ("qqp", round(y["ε=3  FFA"])) not in dots


def _train_scoring_lr(cfg, resume=False, progress=False, log=None):
    """A fake trainer: writes the run folder of ``cfg`` with val and test score 0.5 + lr (the largest rate wins)."""
    folder = Path(cfg.output)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    (folder / "summary.json").write_text(json.dumps({
        "steps": 1, "privacy": {"private": cfg.dp}, "eval": {"val": {"score": 0.5 + cfg.lr}},
        "scores": {cfg.task: 0.5 + cfg.lr}}))


def test_excluded_groups_are_not_in_the_plan_nor_in_the_learning_rate_table(tmp_path):
    """`exclude` leaves a (task, method, setting) out: no tuning row for it (it used to show as a row of '…'
    forever), and the plan is done once the other groups are."""
    from prismdp.experiment.tuning import Plan

    exp = load_experiment({"name": "T", "output": str(tmp_path), "tasks": {"sst2": {}, "qqp": {}},
                           "base": {"holdout_val": 10}, "methods": ["prism", "dp-adamw"], "privacy": [3], "seeds": [1],
                           "lrs": [1e-3, 3e-3], "tune": {"by": "val", "widen": 0}, "exclude": ["qqp__dp-adamw__*"]})
    run_experiment(exp, progress=False, log=lambda *a: None, train_fn=_train_scoring_lr)
    plan = Plan(exp, tmp_path)
    assert set(plan.groups) == {("sst2", "prism", "eps3"), ("sst2", "dp-adamw", "eps3"), ("qqp", "prism", "eps3")}
    assert plan.done()
    md = (tmp_path / "results.md").read_text()
    assert "| qqp | ε=3 | PRISM |" in md and "| qqp | ε=3 | AdamW |" not in md


def test_a_tuned_run_of_a_subset_writes_the_tables_of_the_whole_grid(tmp_path):
    """`--methods prism` on a tuned grid whose DP-AdamW cells are done must not drop DP-AdamW from results.md /
    results.csv (every process of a grid rewrites them; each used to write only its own subset)."""
    exp = load_experiment({"name": "T", "output": str(tmp_path), "tasks": {"sst2": {}}, "base": {"holdout_val": 10},
                           "methods": ["prism", "dp-adamw"], "privacy": [3], "seeds": [1], "lrs": [1e-3, 3e-3],
                           "tune": {"by": "val", "widen": 0}})
    run_experiment(exp, methods=["dp-adamw"], progress=False, log=lambda *a: None, train_fn=_train_scoring_lr)
    run_experiment(exp, methods=["prism"], progress=False, log=lambda *a: None, train_fn=_train_scoring_lr)
    md = (tmp_path / "results.md").read_text()
    assert "| ε=3 | PRISM |" in md and "|  | AdamW |" in md
    assert {r["method"] for r in csv.DictReader(open(tmp_path / "results.csv"))} == {"prism", "dp-adamw"}


def test_cost_of_privacy_is_each_methods_non_dp_mean_minus_its_private_mean(tmp_path):
    """results.md's cost table: per task and method, the non-DP mean, then per privacy level the private mean and
    non-DP minus it; a method without a private run at a level shows '–' there."""
    exp = load_experiment({"name": "T", "output": str(tmp_path), "tasks": {"sst2": {}},
                           "methods": ["prism", "dp-adamw"], "privacy": [3, 6, "non-dp"], "seeds": [1, 2]})
    cells = exp.cells()
    base = {"prism": 0.84, "dp-adamw": 0.85}
    drop = {("prism", 3): 0.03, ("prism", 6): 0.02, ("dp-adamw", 3): 0.07, ("dp-adamw", 6): None}
    for c in cells:
        if c.setting.dp and drop[(c.method, int(c.setting.epsilon))] is None:
            continue  # no AdamW run at epsilon 6
        cost = drop[(c.method, int(c.setting.epsilon))] if c.setting.dp else 0.0
        _fake_cell(c, {"sst2": base[c.method] - cost + (0.01 if c.seed == 2 else -0.01)})
    write_results(exp, cells, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "| Task | Method | Non-DP | ε=3 | cost | ε=6 | cost |" in md
    assert "| SST-2 | PRISM | 0.840 | 0.810 | 0.030 | 0.820 | 0.020 |" in md
    assert "| SST-2 | AdamW | 0.850 | 0.780 | 0.070 | – | – |" in md


def test_combined_scores_are_split_into_accuracy_and_f1_of_the_reported_set_against_its_majority_class(tmp_path):
    """QQP's score is (accuracy + F1) / 2: results.md shows its parts on the reported set (`test`, not the tuning
    `val`, whose numbers differ here), the majority class's accuracy (a range where the seeds' held-out sets differ)
    and the runs whose accuracy is strictly above it (a run exactly at the majority class learned nothing).  SST-2,
    scored by accuracy alone, gets no row."""
    exp = load_experiment({"name": "T", "output": str(tmp_path), "tasks": {"qqp": {}, "sst2": {}},
                           "methods": ["prism", "dp-adamw"], "privacy": [3], "seeds": [1, 2]})
    cells = exp.cells()
    test = {("prism", 1): (0.632, 0.20, 0.632), ("prism", 2): (0.600, 0.40, 0.640),
            ("dp-adamw", 1): (0.700, 0.55, 0.632), ("dp-adamw", 2): (0.650, 0.50, 0.640)}
    for c in cells:
        folder = Path(c.config.output)
        folder.mkdir(parents=True)
        if c.task_id == "qqp":
            acc, f1, maj = test[(c.method, c.seed)]
            ev = {"test": {"accuracy": acc, "f1": f1, "majority_baseline": maj, "score": (acc + f1) / 2},
                  "val": {"accuracy": 0.9, "f1": 0.9, "majority_baseline": 0.5, "score": 0.9}}
        else:
            ev = {"validation": {"accuracy": 0.8, "majority_baseline": 0.51, "score": 0.8}}
        (folder / "summary.json").write_text(json.dumps({"steps": 1, "privacy": {"private": True}, "eval": ev}))
    write_results(exp, cells, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "| Task | Setting | Method | accuracy | F1 | majority class | runs above it |" in md
    assert "| QQP | ε=3 | PRISM | 0.616 ± 0.023 | 0.300 ± 0.141 | 0.632-0.640 | 0/2 |" in md
    assert "| QQP | ε=3 | AdamW | 0.675 ± 0.035 | 0.525 ± 0.035 | 0.632-0.640 | 2/2 |" in md
    assert "| SST-2 | ε=3 |" not in md
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert {r["value"] for r in rows if r["metric"] == "majority_baseline" and r["column"] == "test"} == \
        {"0.632", "0.64"}


def test_pooled_sign_test_counts_every_paired_seed_and_drops_ties(tmp_path):
    """The pooled table: AdamW's 12 private pairs (2 tasks x 2 epsilons x 3 seeds) = 10 PRISM wins, 1 loss, 1 tie ->
    sign test on 10 of 11: p = 2 (1 + 11) / 2^11; its 6 non-DP pairs all lost: p = 2 / 2^6.  FFA, compared on one
    (task, setting) only, is not pooled."""
    import math

    exp = load_experiment({"name": "T", "output": str(tmp_path), "tasks": {"sst2": {}, "qqp": {}},
                           "methods": ["prism", "dp-adamw", "ffa"], "privacy": [3, 6, "non-dp"], "seeds": [1, 2, 3]})
    cells = exp.cells()
    gaps = iter([0.02] * 5 + [-0.04] + [0.02] * 5 + [0.0])  # PRISM minus AdamW, private cells in grid order
    for c in cells:
        if c.method == "ffa" and (c.task_id, c.setting.key) != ("sst2", "eps3"):
            continue
        if c.method == "dp-adamw":
            gap = next(gaps) if c.setting.dp else -0.01
        else:
            gap = 0.01 if c.method == "ffa" else 0.0
        _fake_cell(c, {c.task_id: 0.5 - gap})
    write_results(exp, cells, tmp_path)
    md = (tmp_path / "results.md").read_text()
    pooled = md.split("## Pooled over tasks")[1].split("\n## ")[0]
    p_private, p_nondp = 2 * (math.comb(11, 0) + math.comb(11, 1)) / 2 ** 11, 2 / 2 ** 6
    assert f"| AdamW | ε=3 + ε=6 | 12 | 10 | 1 | +0.013 | {p_private:.3f} |" in pooled
    assert f"| AdamW | Non-DP | 6 | 0 | 6 | -0.010 | {p_nondp:.3f} |" in pooled
    assert "FFA" not in pooled


def test_bold_avg_goes_to_the_best_complete_row_not_to_a_daggered_one(tmp_path):
    """LAMB runs on SST-2 only: its Avg (0.9, one column) is not comparable with the two-column Avgs, so it is not
    bold even though larger; PRISM's (0.7) is.  Each column's best is still bold on its own."""
    exp = load_experiment({"name": "T", "output": str(tmp_path), "tasks": {"sst2": {}, "qqp": {}},
                           "methods": ["prism", "dp-adamw", "lamb"], "privacy": [3], "seeds": [1]})
    cells = exp.cells()
    scores = {("prism", "sst2"): 0.8, ("prism", "qqp"): 0.6, ("dp-adamw", "sst2"): 0.7, ("dp-adamw", "qqp"): 0.5,
              ("lamb", "sst2"): 0.9}
    for c in cells:
        if (c.method, c.task_id) in scores:
            _fake_cell(c, {c.task_id: scores[(c.method, c.task_id)]})
    write_results(exp, cells, tmp_path)
    rows = {line.split("|")[2].strip(): line for line in (tmp_path / "results.md").read_text().splitlines()
            if line.startswith("| ") and line.count("|") == 6}
    assert rows["PRISM"].endswith("| **0.700** |") and rows["AdamW"].endswith("| 0.600 |")
    assert rows["LAMB"].endswith("| 0.900† |") and "| **0.900** |" in rows["LAMB"]  # its SST-2 is the column's best


def _train_qqp_like(cfg, resume=False, progress=False, log=None):
    """A fake trainer with a QQP-like `val`: accuracy and F1 whose mean (the eval set's score, what tuning reads)
    peaks at lr 1e-3 while accuracy alone peaks at 3e-3; the reported `test` differs by seed and method."""
    import math

    x = math.log10(cfg.lr)
    acc, f1 = 0.7 - 0.02 * abs(x + 2.5), 0.6 - 0.2 * abs(x + 3)
    dev = acc - 0.01 * (cfg.seed - 1) + (0.02 if cfg.method == "prism" else 0.0)
    folder = Path(cfg.output)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    priv = {"private": cfg.dp, **({"epsilon": 2.99, "delta": 1e-5, "noise_multiplier": 0.7} if cfg.dp else {})}
    (folder / "summary.json").write_text(json.dumps({
        "steps": cfg.steps, "privacy": priv, "eval_time_s": 1.5, "train": {"peak_memory_mb": 100.0 + cfg.seed},
        "eval": {"val": {"accuracy": acc, "f1": f1, "score": (acc + f1) / 2, "n": 1000},
                 "test": {"accuracy": dev, "f1": 0.5, "score": (dev + 0.5) / 2, "majority_baseline": 0.63,
                          "n": 2000}}}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "step_time_s": 0.1 * cfg.seed})
                                                  + "\n" for s in range(1, cfg.steps + 1)))


def _qqp_grid(out):
    return {"name": "T", "output": str(out), "tasks": {"qqp": {"holdout_test": 20}},
            "base": {"steps": 2, "holdout_val": 10},
            "methods": ["prism", "dp-adamw"], "privacy": [3, "non-dp"], "seeds": [1, 2],
            "lrs": [3e-4, 1e-3, 3e-3, 1e-2], "tune": {"by": "val", "widen": 1}}


def _never_train(*a, **k):
    raise AssertionError("a cell kept in --results-from was trained again")


def test_a_grid_rebuilt_from_its_results_csv_alone_gives_the_same_tables_and_trains_nothing(tmp_path):
    """Run folders gone, results.csv kept: `--results-from` must give byte-identical results.csv / results.md (the
    same rates chosen: QQP's val score is (acc + F1) / 2, recomputed from the metrics the csv keeps; accuracy alone
    would choose 3e-3 instead of 1e-3), count every cell as done, and a grid split in two folders (one per method,
    e.g. two machines) merges into the tables of the whole grid."""
    whole = tmp_path / "whole"
    exp = load_experiment(_qqp_grid(whole))
    run_experiment(exp, progress=False, log=lambda *a: None, train_fn=_train_qqp_like)
    md = (whole / "results.md").read_text()
    assert "| qqp | ε=3 | PRISM | 0.5875 | **0.6450** | 0.6021 | 0.5450 | 0.001 |" in md  # val (acc + F1) / 2
    assert "| QQP | ε=3 | PRISM | 0.705 ± 0.007 | 0.500 ± 0.000 | 0.630 | 2/2 |" in md  # test, not val
    rebuilt = tmp_path / "rebuilt"
    run = run_experiment(load_experiment(_qqp_grid(rebuilt)), progress=False, log=lambda *a: None,
                         train_fn=_never_train, results_from=[str(whole / "results.csv")])
    assert not run.failures and not run.ran
    assert (rebuilt / "results.md").read_text() == md
    assert (rebuilt / "results.csv").read_text() == (whole / "results.csv").read_text()

    # split: AdamW's cells on one machine, PRISM's on another; merged with the other's csv
    a, b = tmp_path / "a", tmp_path / "b"
    run_experiment(load_experiment(_qqp_grid(a)), methods=["dp-adamw"], progress=False, log=lambda *x: None,
                   train_fn=_train_qqp_like)
    run_experiment(load_experiment(_qqp_grid(b)), methods=["prism"], progress=False, log=lambda *x: None,
                   train_fn=_train_qqp_like)
    run_experiment(load_experiment(_qqp_grid(b)), progress=False, log=lambda *x: None, train_fn=_never_train,
                   results_from=[str(a / "results.csv")])
    assert (b / "results.md").read_text() == md

    # a grid without tuning, the same way
    plain = {**_qqp_grid(tmp_path / "plain"), "base": {"steps": 2, "lr": 1e-3}}
    del plain["lrs"], plain["tune"]
    run_experiment(load_experiment(plain), progress=False, log=lambda *x: None, train_fn=_train_qqp_like)
    again = load_experiment({**plain, "output": str(tmp_path / "plain2")})
    run = run_experiment(again, progress=False, log=lambda *x: None, train_fn=_never_train,
                         results_from=[str(tmp_path / "plain" / "results.csv")])
    assert len(run.skipped) == 8 and not run.ran and not run.failures
    assert (tmp_path / "plain2" / "results.md").read_text() == (tmp_path / "plain" / "results.md").read_text()


def test_results_from_a_different_grid_is_an_error_naming_the_file_and_cell(tmp_path, capsys):
    whole = tmp_path / "whole"
    run_experiment(load_experiment(_qqp_grid(whole)), progress=False, log=lambda *a: None, train_fn=_train_qqp_like)
    kept = str(whole / "results.csv")
    longer = load_experiment(_qqp_grid(tmp_path / "other"), {"steps": 3})
    wrong = r"results\.csv: cell qqp__prism__eps3__lr0\.0003__seed1 differs .*steps 2 vs 3"
    with pytest.raises(ConfigError, match=wrong):
        run_experiment(longer, progress=False, log=lambda *a: None, train_fn=_never_train, results_from=[kept])
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump(_qqp_grid(tmp_path / "other")))
    assert main(["experiment", str(grid), "--dry-run", "--results-from", str(tmp_path / "nope.csv")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_budget_curves_pair_each_seed_at_each_step_budget(tmp_path):
    """A task trained at two step budgets (task ids sst2 and sst2-x4): results.md's budget table has, per setting and
    budget, each method's mean ± std and PRISM minus AdamW paired by seed; budget.png has one panel per task with a
    dot per seed at its step budget (x) and score (y).  Tasks trained at one budget only (cola) are not in it."""
    pytest.importorskip("matplotlib")
    from matplotlib.collections import PathCollection

    from prismdp.experiment.budget import budget_figure, budget_points
    from prismdp.experiment.tables import read_cell

    exp = load_experiment({"name": "B", "output": str(tmp_path),
                           "tasks": {"sst2": {"steps": 80}, "sst2-x4": {"task": "sst2", "steps": 320},
                                     "cola": {"steps": 80}},
                           "methods": ["prism", "dp-adamw"], "privacy": [3, 6], "seeds": [1, 2]})
    cells = exp.cells()
    for c in cells:  # PRISM ahead by 0.02 (0.04 on seed 2) at 80 steps, behind by 0.03 at 320 steps; eps 6 +0.1
        lead = (0.02 + 0.02 * (c.seed == 2)) if c.config.steps == 80 else -0.03
        score = 0.7 + (0.1 if c.config.steps == 320 else 0.0) + (0.1 if c.setting.epsilon == 6 else 0.0) \
            + (lead if c.method == "prism" else 0.0) + 0.002 * c.seed
        _fake_cell(c, {c.config.task: score})
    write_results(exp, cells, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "| Task | Setting | Steps | PRISM | AdamW | PRISM − AdamW | wins |" in md
    assert "| SST-2 | ε=3 | 80 | 0.733 ± 0.016 | 0.703 ± 0.001 | +0.030 | 2/2 |" in md
    assert "| SST-2 | ε=3 | 320 | 0.773 ± 0.001 | 0.803 ± 0.001 | -0.030 | 0/2 |" in md
    assert "| SST-2 | ε=6 | 320 | 0.873 ± 0.001 | 0.903 ± 0.001 | -0.030 | 0/2 |" in md
    assert "| CoLA |" not in md.split("## Step budget")[1]
    # pooled over tasks per privacy level (sst2, sst2-x4 and cola: 4 wins, 2 losses) and per budget (the 80-step
    # tasks sst2 and cola: 8 wins of 8, p = 2 / 2^8; 320 steps: 4 losses of 4, p = 2 / 2^4)
    by = md.split("## Pooled by privacy level and by step budget")[1].split("\n## ")[0]
    assert "| AdamW | ε=3 | sst2, sst2-x4, cola | 6 | 4 | 2 | +0.010 | 0.688 |" in by
    assert "| AdamW | 1x steps (ε=3 + ε=6) | sst2, cola | 8 | 8 | 0 | +0.030 | 0.008 |" in by
    assert "| AdamW | 4x steps (ε=3 + ε=6) | sst2-x4 | 4 | 0 | 4 | -0.030 | 0.125 |" in by
    assert (tmp_path / "budget.png").stat().st_size > 1000
    points = budget_points(exp, cells, [r for r in (read_cell(c) for c in cells) if r is not None])
    assert {(p.setting_key, p.method, p.steps) for p in points} == {
        (s, m, n) for s in ("eps3", "eps6") for m in ("prism", "dp-adamw") for n in (80, 320)}
    (ax,) = budget_figure(exp, points).axes
    dots = sorted((int(x), round(float(y), 3)) for coll in ax.collections if isinstance(coll, PathCollection)
                  for x, y in coll.get_offsets())
    assert len(dots) == 16 and (320, 0.772) in dots and (80, 0.722) in dots and (80, 0.744) in dots


def test_tuning_chooses_the_rate_that_peaks_on_val_not_the_one_that_peaks_on_the_reported_dev_set(tmp_path):
    """val (held-out training examples) peaks at lr 1e-3 and the reported dev set (`validation`) at 1e-2, for both
    methods: every group chooses 1e-3 (inside the grid: no widening), the other seed runs only there, and the tables
    report the dev scores of the 1e-3 runs.  Tuned on dev, 1e-2 (at the edge, then widened to 3e-2) would win."""
    import math

    from prismdp.experiment.tuning import Plan

    trained = []

    def fake_train(cfg, resume=False, progress=False, log=None):
        trained.append((cfg.lr, cfg.seed))
        val = 0.9 - 0.1 * abs(math.log10(cfg.lr / 1e-3))
        dev = 0.8 - 0.1 * abs(math.log10(cfg.lr / 1e-2)) + 0.01 * cfg.seed
        folder = Path(cfg.output)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
        (folder / "summary.json").write_text(json.dumps({
            "steps": 1, "privacy": {"private": cfg.dp}, "eval": {"val": {"score": val}, "validation": {"score": dev}}}))

    exp = load_experiment({"name": "T", "output": str(tmp_path), "tasks": {"sst2": {}}, "base": {"holdout_val": 10},
                           "methods": ["dp-adamw", "prism"], "privacy": [3], "seeds": [1, 2],
                           "lrs": [3e-4, 1e-3, 3e-3, 1e-2], "tune": {"by": "val", "widen": 1}})
    run = run_experiment(exp, progress=False, log=lambda *a: None, train_fn=fake_train)
    assert not run.failures
    plan = Plan(exp, tmp_path)
    assert {k: g.chosen for k, g in plan.groups.items()} == {("sst2", m, "eps3"): 1e-3 for m in ("dp-adamw", "prism")}
    assert sorted(set(trained)) == sorted({(lr, 1) for lr in (3e-4, 1e-3, 3e-3, 1e-2)} | {(1e-3, 2)})
    rows = [r for r in csv.DictReader(open(tmp_path / "results.csv")) if r["seed"] == "2"]
    assert len(rows) == 2 and {r["lr"] for r in rows} == {"0.001"}
    md = (tmp_path / "results.md").read_text()
    assert "| ε=3 | AdamW | **0.715 ± 0.007** |" in md  # dev at 1e-3: 0.8 - 0.1 + 0.01 x seed, seeds 1 and 2
    assert "| sst2 | ε=3 | PRISM | 0.8477 | **0.9000** | 0.8523 | 0.8000 | 0.001 |" in md  # val, chosen 1e-3


@pytest.mark.parametrize("task, layer, by, column", [
    ("sst2", {"holdout_val": 10}, "validation", "sst2"),                       # SST-2's dev set
    ("qqp", {"holdout_val": 10, "holdout_test": 20}, "test", "qqp"),          # QQP's held-out test split
    ("mnli", {"holdout_val": 10}, "validation_matched", "mnli"),              # half of MNLI's column
    ("synthetic", {}, "test", "synthetic"),
])
def test_tuning_on_a_split_the_tables_report_is_refused_when_the_grid_is_loaded(tmp_path, capsys, task, layer, by,
                                                                               column):
    grid = {"name": "T", "output": str(tmp_path / "out"), "tasks": {task: layer}, "methods": ["prism"],
            "privacy": [3], "seeds": [1], "lrs": [1e-3, 3e-3], "tune": {"by": by}}
    with pytest.raises(ConfigError, match=rf"tune: by: '{by}' is an eval set the tables report \(the {column} column"):
        load_experiment(grid)
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    assert main(["experiment", str(path), "--quiet"]) == 2  # refused before any cell is trained
    err = capsys.readouterr().err
    assert "tune: {by: val}" in err and "holdout_val" in err
    assert not (tmp_path / "out").exists()


def test_tuning_on_val_is_refused_where_a_cell_holds_out_no_val_split(tmp_path):
    """`by: val` needs every tuned cell to carve `val` from its training data (holdout_val); without it every rate
    used to score NaN and the smallest rate was chosen silently."""
    grid = {"name": "T", "output": str(tmp_path), "tasks": {"sst2": {"holdout_val": 10}, "qqp": {}},
            "methods": ["prism"], "privacy": [3], "seeds": [1], "lrs": [1e-3, 3e-3], "tune": {"by": "val"}}
    with pytest.raises(ConfigError, match=r"tune: by: val needs holdout_val .* qqp.*holdout_val: N"):
        load_experiment(grid)
    load_experiment({**grid, "base": {"holdout_val": 10}})  # in base: every task has it
    with pytest.raises(ConfigError, match=r"task 'synthetic' .* no held-out tuning split"):
        load_experiment({**grid, "tasks": {"synthetic": {}}})
    with pytest.raises(ConfigError, match=r"tune: by: 'dev': no run of this grid evaluates"):
        load_experiment({**grid, "base": {"holdout_val": 10}, "tune": {"by": "dev"}})
