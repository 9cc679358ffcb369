"""scripts/noise-to-signal.py (issue 45): the ratio B / (sigma sqrt D) of a run folder, counted by hand."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]


def _run(folder, tensors, rank):
    (folder / "adapter").mkdir(parents=True)
    save_file(tensors, str(folder / "adapter" / "adapter_model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"rank": rank, "method": "prism"}))
    (folder / "privacy.json").write_text(json.dumps({"dataset_size": 1000, "expected_batch_size": 10.0, "steps": 4,
                                                     "noise_multiplier": 0.5, "target_epsilon": 3.0, "delta": 1e-5,
                                                     "accountant": "rdp"}))
    return folder


def test_the_ratio_counts_every_trained_coordinate_and_the_calibrated_rows_use_the_folders_budget(tmp_path):
    """D = 100 trained coordinates: LoRA r 4 (A 4 x 16, B 9 x 4) and no other tensor, B 10, sigma 0.5, T 4:
    10 / (0.5 x 10) = 2.000 per step, 4.00 over the run (a D that missed a tensor, 64, would give 2.500).  The same
    run exported as PRISM exports it, at rank 2r with the fixed start beside the trained factors (A 8 x 16,
    B 9 x 8), has the same D (counting the exported tensors, 200, gave 1.414).  A calibrated row at B 20 takes the
    folder's epsilon, delta, N, T and accountant: its sigma is the library's calibrate_sigma for q = 20 / N."""
    from prismdp.privacy.accounting import calibrate_sigma

    plain = _run(tmp_path / "plain", {"a.lora_A.weight": torch.zeros(4, 16), "a.lora_B.weight": torch.zeros(9, 4)}, 4)
    moved = _run(tmp_path / "moved", {"a.lora_A.weight": torch.zeros(8, 16), "a.lora_B.weight": torch.zeros(9, 8)}, 4)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "noise-to-signal.py"), str(plain), str(moved),
                          "--batches", "20"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in res.stdout.splitlines()[2:]]
    assert rows[0] == ["plain", "100", "10", "4", "0.5000", "2.000", "4.00", "40"]
    assert rows[2] == ["moved", "100", "10", "4", "0.5000", "2.000", "4.00", "40"]
    sigma = calibrate_sigma(3.0, 1e-5, 20 / 1000, 4, "rdp")
    assert rows[1][4:6] == [f"{sigma:.4f}", f"{20 / (sigma * 10):.3f}"]


def test_a_dense_tensor_counts_whole(tmp_path):
    """A head saved beside the LoRA factors (modules_to_save) is trained whole: 100 + 2 x 3 = 106."""
    run = _run(tmp_path / "run", {"a.lora_A.weight": torch.zeros(8, 16), "a.lora_B.weight": torch.zeros(9, 8),
                                  "score.weight": torch.zeros(2, 3)}, 4)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "noise-to-signal.py"), str(run)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines()[2].split("|")[2].strip() == "106"


def test_calibrated_rows_for_other_adapters_use_their_coordinates(tmp_path):
    """--coordinates 400: the calibrated row at B 20 divides by sqrt(400) = 20 instead of the folder's sqrt(100)."""
    from prismdp.privacy.accounting import calibrate_sigma

    run = _run(tmp_path / "run", {"a.lora_A.weight": torch.zeros(4, 16), "a.lora_B.weight": torch.zeros(9, 4)}, 4)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "noise-to-signal.py"), str(run), "--batches", "20",
                          "--coordinates", "400"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    cells = [c.strip() for c in res.stdout.splitlines()[3].split("|")[1:-1]]
    sigma = calibrate_sigma(3.0, 1e-5, 20 / 1000, 4, "rdp")
    assert cells[1] == "400" and cells[5] == f"{20 / (sigma * 20):.3f}"
