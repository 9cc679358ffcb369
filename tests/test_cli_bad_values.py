"""Issue 42: every numeric flag of `prismdp train`, `epsilon`, `audit`, `tune` and `experiment` refuses bad values
with exit status 2, exactly one line on stderr, nothing on stdout and no run folder (for `tune`: no tune.json), before
any model is loaded.

The table is generated from the parsers (and, for `experiment --set KEY=VALUE`, from TrainConfig's fields), so a new
flag is covered without editing this file; a numeric flag must use :func:`prismdp.flags.integer`,
:func:`prismdp.flags.finite_float`, or their comma-separated lists :func:`prismdp.flags.integers` /
:func:`prismdp.flags.finite_floats` (checked).  Zero is a bad value except where listed in ``ZERO_OK``.
"""

import argparse
import dataclasses

import pytest
import yaml

from prismdp.cli import build_parser, main
from prismdp.experiment.grid import _CELL_KEYS
from prismdp.experiment import honest
from prismdp.flags import csv_list, finite_float, finite_floats, integer, integers, yaml_mapping
from prismdp.train.config import TrainConfig

INT_BAD = ["-1", "1.5", "abc", "", "nan", "1e3", str(2**63), "9" * 30]
FLOAT_BAD = ["-1", "nan", "inf", "-inf", "abc", "", "1e999"]
INTS_BAD = ["", ",", "abc", "1.5", "-1", "nan", "4,-1", "4,abc", "4,1.5", str(2**63)]
FLOATS_BAD = ["", ",", "abc", "nan", "inf", "-1", "1e999", "1e-3,nan", "1e-3,-1", "1e-3,abc", "1e-3,0"]
BAD = {integer: INT_BAD, finite_float: FLOAT_BAD, integers: INTS_BAD, finite_floats: FLOATS_BAD, int: INT_BAD,
       float: FLOAT_BAD}
ZERO_OK = {"train": {"seed", "dropout"}, "audit": {"seed", "dropout"}, "epsilon": {"steps"},
           "experiment": {"dropout"}, "tune": {"seed", "dropout", "tune_seed"}}
TUNE = ["tune", "--output", "{out}", "--task", "sst2", "--holdout-val", "10", "--steps", "2", "--batch-size", "10",
        "--delta", "1e-3", "--accountant", "rdp", "--lrs", "1e-3", "--trials", "grid"]
BASE = {  # a valid command line around the flag under test ({out}: the run folder, which must not appear)
    "train": ["train", "--output", "{out}"],
    "audit": ["audit", "--output", "{out}"],
    "epsilon": ["epsilon", "--sigma", "1", "--sample-rate", "0.01", "--steps", "10"],
    "tune": TUNE,
}
COMMANDS = ("train", "audit", "epsilon", "tune")
CHECKED = (integer, finite_float, integers, finite_floats, csv_list, yaml_mapping, str, None)


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _numeric(command: str) -> list[argparse.Action]:
    return [a for a in _subparser(command)._actions if a.type in BAD]


def _cases():
    for command in COMMANDS:
        for action in _numeric(command):
            if action.help == argparse.SUPPRESS:
                continue  # a hidden test hook
            bad = BAD[action.type]
            zero = [] if action.dest in ZERO_OK[command] else ["0"]
            for value in bad + zero:
                flag = action.option_strings[0]
                yield pytest.param(command, flag, value, id=f"{command} {flag}={value}")


def _set_cases():
    for f in dataclasses.fields(TrainConfig):
        kind = str(f.type)
        if f.name in _CELL_KEYS or not kind.startswith(("int", "float")):
            continue
        bad = ["-1", "abc", ".nan", ".inf", "1e999"] + (["1.5", str(2**63)] if kind.startswith("int") else [])
        zero = [] if f.name in ZERO_OK["experiment"] else ["0"]
        for value in bad + zero:
            yield pytest.param(f"{f.name}={value}", id=f"--set {f.name}={value}")


def _run(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse
        return e.code


def _refused(argv, capsys, folder):
    rc = _run(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (argv, rc, out, err)
    assert err.count("\n") == 1 and err.endswith("\n") and "error" in err, err
    assert not folder.exists(), folder


def test_every_numeric_flag_is_declared_with_a_checked_type():
    """A plain ``type=int`` / ``type=float`` accepts nan, inf and 10**30, and a home-made list parser (a lambda)
    hides a numeric flag from this file's table: every flag must use one of the checked types, so that the table
    covers it."""
    plain = [(c, a.option_strings[0], a.type) for c in (*COMMANDS, "experiment")
             for a in _subparser(c)._actions if a.option_strings and a.type not in CHECKED]
    assert not plain, plain


@pytest.fixture
def no_tuning_work(monkeypatch):
    """`prismdp tune` with a valid base: the task's size without reading any data, and no training (a bad value that
    got through would plan the tuning, write tune.json and reach this stub)."""
    monkeypatch.setattr(honest, "_dataset", lambda cfg: (50, 10))

    def no_training(cfg, **kw):
        raise AssertionError(f"a bad value reached training: {cfg.output}")

    import prismdp.train.loop
    monkeypatch.setattr(prismdp.train.loop, "train", no_training)


def test_the_tune_base_command_is_valid(no_tuning_work, tmp_path, capsys):
    """The base arguments alone go through (so that in the table only the bad value is wrong)."""
    out = tmp_path / "run"
    with pytest.raises(AssertionError, match="reached training"):
        _run([a.format(out=out) for a in TUNE])
    assert (out / honest.PLAN_FILE).is_file()


@pytest.mark.parametrize("command, flag, value", list(_cases()))
def test_a_bad_numeric_flag_is_refused_in_one_line(command, flag, value, tmp_path, capsys, monkeypatch,
                                                   no_tuning_work):
    monkeypatch.chdir(tmp_path)  # a default run folder would appear here
    out = tmp_path / "run"
    argv = [a.format(out=out) for a in BASE[command]]
    if command == "epsilon" and flag == "--sigma":
        argv = argv[:1] + argv[3:]
    if command == "epsilon" and flag == "--target-epsilon":
        argv = argv[:1] + argv[3:]
    _refused([*argv, f"{flag}={value}"], capsys, out)
    assert not (tmp_path / "runs").exists()


def _grid(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({"name": "bad", "output": str(tmp_path / "out"),
                                    "base": {"synthetic_train": 64, "steps": 2, "batch_size": 16},
                                    "tasks": {"synthetic": {}}, "methods": ["prism"], "privacy": [3], "seeds": [7]}))
    return path


@pytest.mark.parametrize("value", ["abc", "1.5", "-1", "nan", "", ",", str(2**63)])
def test_experiment_bad_seeds_are_refused_in_one_line(value, tmp_path, capsys):
    _refused(["experiment", str(_grid(tmp_path)), f"--seeds={value}"], capsys, tmp_path / "out")


@pytest.mark.parametrize("item", list(_set_cases()))
def test_experiment_bad_numeric_settings_are_refused_in_one_line(item, tmp_path, capsys):
    _refused(["experiment", str(_grid(tmp_path)), "--set", item], capsys, tmp_path / "out")


@pytest.mark.parametrize("spec", ["", "grid:2", "geometric", "geometric:1", "geometric:nan", "geometric:inf",
                                  "geometric:1e999", "geometric:abc", "poisson:0", "poisson:-1", "fixed:0", "fixed:-1",
                                  "fixed:2.5", "fixed:nan", "fixed:inf", "fixed:1e300", "fixed:" + "9" * 30,
                                  "negative-binomial:0:5", "negative-binomial:nan:5", "negative-binomial:inf:5",
                                  "negative-binomial:5", "logarithmic:1", "fixed:10000000"])
def test_tune_bad_trial_counts_are_refused_in_one_line(spec, no_tuning_work, tmp_path, capsys):
    out = tmp_path / "run"
    _refused([*[a.format(out=out) for a in TUNE], f"--trials={spec}"], capsys, out)
