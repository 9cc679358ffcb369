"""Issue 42: every numeric flag of `prismdp train`, `epsilon`, `audit` and `experiment` refuses bad values with exit
status 2, exactly one line on stderr, nothing on stdout and no run folder, before any model is loaded.

The table is generated from the parsers (and, for `experiment --set KEY=VALUE`, from TrainConfig's fields), so a new
flag is covered without editing this file; a numeric flag must use :func:`prismdp.flags.integer` or
:func:`prismdp.flags.finite_float` (checked).  Zero is a bad value except where listed in ``ZERO_OK``.
"""

import argparse
import dataclasses

import pytest
import yaml

from prismdp.cli import build_parser, main
from prismdp.experiment.grid import _CELL_KEYS
from prismdp.flags import finite_float, integer
from prismdp.train.config import TrainConfig

INT_BAD = ["-1", "1.5", "abc", "", "nan", "1e3", str(2**63), "9" * 30]
FLOAT_BAD = ["-1", "nan", "inf", "-inf", "abc", "", "1e999"]
ZERO_OK = {"train": {"seed", "dropout"}, "audit": {"seed", "dropout"}, "epsilon": {"steps"},
           "experiment": {"dropout"}}
BASE = {  # a valid command line around the flag under test ({out}: the run folder, which must not appear)
    "train": ["train", "--output", "{out}"],
    "audit": ["audit", "--output", "{out}"],
    "epsilon": ["epsilon", "--sigma", "1", "--sample-rate", "0.01", "--steps", "10"],
}


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _numeric(command: str) -> list[argparse.Action]:
    return [a for a in _subparser(command)._actions if a.type in (integer, finite_float, int, float)]


def _cases():
    for command in ("train", "audit", "epsilon"):
        for action in _numeric(command):
            if action.help == argparse.SUPPRESS:
                continue  # a hidden test hook
            bad = INT_BAD if action.type in (integer, int) else FLOAT_BAD
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
    """A plain ``type=int`` / ``type=float`` accepts nan, inf and 10**30: every numeric flag must use the checked
    types, so that this file's table covers it."""
    plain = [(c, a.option_strings[0]) for c in ("train", "audit", "epsilon", "experiment")
             for a in _numeric(c) if a.type in (int, float)]
    assert not plain, plain


@pytest.mark.parametrize("command, flag, value", list(_cases()))
def test_a_bad_numeric_flag_is_refused_in_one_line(command, flag, value, tmp_path, capsys, monkeypatch):
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
