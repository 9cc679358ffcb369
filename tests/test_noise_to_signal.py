"""scripts/noise-to-signal.py (issue 45): the ratio B / (sigma sqrt D) of a run folder, counted by hand."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]


def test_the_ratio_counts_every_adapter_coordinate_and_the_calibrated_rows_use_the_folders_budget(tmp_path):
    """D = 100 coordinates in two tensors, B 10, sigma 0.5, T 4: 10 / (0.5 x 10) = 2.000 per step, 4.00 over the run
    (a D that missed a tensor, 64, would give 2.500).  A calibrated row at B 20 takes the folder's epsilon, delta,
    N, T and accountant: its sigma is the library's calibrate_sigma for q = 20 / N."""
    from prismdp.privacy.accounting import calibrate_sigma

    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    save_file({"a.lora_A.weight": torch.zeros(4, 16), "a.lora_B.weight": torch.zeros(9, 4)},
              str(run / "adapter" / "adapter_model.safetensors"))
    (run / "privacy.json").write_text(json.dumps({"dataset_size": 1000, "expected_batch_size": 10.0, "steps": 4,
                                                  "noise_multiplier": 0.5, "target_epsilon": 3.0, "delta": 1e-5,
                                                  "accountant": "rdp"}))
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "noise-to-signal.py"), str(run), "--batches", "20"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in res.stdout.splitlines()[2:]]
    assert [c.strip() for c in rows[0]] == ["run", "100", "10", "4", "0.5000", "2.000", "4.00", "40"]
    sigma = calibrate_sigma(3.0, 1e-5, 20 / 1000, 4, "rdp")
    assert [c.strip() for c in rows[1]][4:6] == [f"{sigma:.4f}", f"{20 / (sigma * 10):.3f}"]
