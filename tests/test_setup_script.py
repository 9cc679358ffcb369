"""scripts/setup.sh's choice of torch, run against a fake Python that records its arguments (nothing is installed):
CI's default is exactly the CPU pin; ``PRISMDP_TORCH_SPEC`` picks another build; ``PRISMDP_KEEP_TORCH=1`` keeps the
torch already there (docs/gpu.md)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
if [ "$1 $2" = "-m venv" ]; then mkdir -p .venv/bin && cp "$0" .venv/bin/python; fi
if [ "$1" = "-c" ] && [ -z "${FAKE_TORCH:-}" ]; then exit 1; fi
exit 0
"""


def _setup(tmp_path, **env):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SETUP, repo / "scripts" / "setup.sh")
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "log"
    log.touch()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PRISMDP_")}
    proc = subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=60,
                          env={**clean, "PYTHON": str(fake), "FAKE_LOG": str(log), **env})
    return proc, log.read_text().splitlines()


def test_default_installs_exactly_the_cpu_pin(tmp_path):
    proc, calls = _setup(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert calls[0] == "-m venv .venv"
    assert [c for c in calls if "torch" in c] == ["-m pip install -q torch==2.13.0"]
    assert '-m pip install -q -e .[test]' in calls


def test_torch_spec_chooses_another_build(tmp_path):
    proc, calls = _setup(tmp_path, PRISMDP_TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128")
    assert proc.returncode == 0, proc.stderr
    assert [c for c in calls if "torch" in c] == ["-m pip install -q torch --index-url "
                                                  "https://download.pytorch.org/whl/cu128"]


@pytest.mark.parametrize("has_torch", [True, False])
def test_keep_torch_installs_none_and_needs_one(tmp_path, has_torch):
    proc, calls = _setup(tmp_path, PRISMDP_KEEP_TORCH="1", **({"FAKE_TORCH": "1"} if has_torch else {}))
    assert calls[0] == "-m venv --system-site-packages .venv"
    assert not [c for c in calls if c.startswith("-m pip install") and "torch" in c]
    if has_torch:
        assert proc.returncode == 0 and '-m pip install -q -e .[test]' in calls
    else:
        assert proc.returncode == 1 and "PRISMDP_KEEP_TORCH=1 but .venv has no torch" in proc.stderr
        assert '-m pip install -q -e .[test]' not in calls
