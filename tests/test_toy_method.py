"""Adding a method touches one file: the toy of tests/toy_method.py, registered through prismdp.engine's public
registry, runs through prismdp train, prismdp experiment and the benchmark's variant list."""

import json

import pytest
import torch
import yaml

import toy_method
from prismdp.cli import main
from prismdp.engine import METHODS

torch.set_num_threads(1)


@pytest.fixture
def toy():
    spec = toy_method.register()
    try:
        yield spec
    finally:
        del METHODS[toy_method.NAME]  # the registry outlives the test; the other tests count the built-in methods


TINY = {"synthetic_train": 64, "synthetic_test": 24, "batch_size": 16, "micro_batch_size": 16, "rank": 2,
        "alpha": 4, "max_length": 24}


def test_prismdp_train_runs_the_toy_method_at_its_default_rate(toy, tiny_bert_dir, tmp_path, capsys):
    out = tmp_path / "run"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    assert main(["train", "--model", tiny_bert_dir, "--method", toy_method.NAME, "--steps", "2", "--epsilon", "8",
                 "--output", str(out), "--quiet", *flags]) == 0
    config = json.loads((out / "config.json").read_text())
    privacy = json.loads((out / "privacy.json").read_text())
    assert config["method"] == toy_method.NAME and config["lr"] == toy_method.LR["demo"]
    assert privacy["method"] == toy_method.NAME and privacy["steps"] == 2 and 0 < privacy["epsilon"] <= 8
    assert "test accuracy" in capsys.readouterr().out


def test_prismdp_experiment_runs_and_labels_the_toy_method(toy, tiny_bert_dir, tmp_path, capsys):
    grid = {"name": "toy", "output": str(tmp_path / "out"), "base": {"model": tiny_bert_dir, "steps": 1, **TINY},
            "tasks": {"synthetic": {}}, "methods": [toy_method.NAME, "prism"], "privacy": [3], "seeds": [7]}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    assert main(["experiment", str(path), "--quiet"]) == 0
    table = (tmp_path / "out" / "results.md").read_text()
    assert f"| {toy_method.LABEL} |" in table and "| PRISM |" in table
    cell = tmp_path / "out" / f"synthetic__{toy_method.NAME}__eps3__seed7"
    assert json.loads((cell / "config.json").read_text())["lr"] == toy_method.LR["demo"]


def test_the_benchmark_lists_and_runs_the_toy_method(toy, tmp_path):
    from bench.__main__ import main as bench_main
    from bench.workloads import available_variants

    assert toy_method.NAME in available_variants()
    assert bench_main(["--workloads", "tiny-bert", "--variants", f"{toy_method.NAME},prism", "--steps", "1",
                       "--warmup", "0", "--threads", "1", "--no-memory", "--micro-sizes", "",
                       "--output", str(tmp_path)]) == 0
    (res,) = json.loads((tmp_path / "bench.json").read_text())["workloads"]
    assert list(res["variants"]) == [toy_method.NAME, "prism"]
    assert 0 < res["variants"][toy_method.NAME]["mechanism_share"] < 1  # a private run: its mechanism was timed
