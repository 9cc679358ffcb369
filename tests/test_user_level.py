"""User-level privacy in `prismdp train` (--privacy-unit user --user-id-column COL): users are Poisson-sampled,
each user's examples stay in one micro-batch, the accountant counts users."""

import json

import pytest
import torch

from prismdp.cli import main
from prismdp.train.step import unit_micro_batches


def test_unit_micro_batches_keep_every_unit_whole_and_number_units_per_micro_batch():
    examples = [{"input_ids": [0] * n} for n in (3, 9, 2, 5, 5, 1, 7)]
    units = [[0, 1], [2], [3, 4, 5], [6]]
    micros = list(unit_micro_batches(units, examples, micro_batch_size=3, group_by_length=False))
    # [0, 1] + [2] = 3 examples; [3, 4, 5] fills one alone; [6]
    assert micros == [([0, 1, 2], [0, 0, 1]), ([3, 4, 5], [0, 0, 0]), ([6], [0])]
    big = list(unit_micro_batches([[0, 1, 2, 3, 4]], examples, micro_batch_size=2, group_by_length=False))
    assert big == [([0, 1, 2, 3, 4], [0] * 5)]  # a unit larger than a micro-batch is never split
    ordered = list(unit_micro_batches(units, examples, micro_batch_size=3, group_by_length=True))
    assert sorted(i for m, _ in ordered for i in m) == list(range(7))


def _records(path, n_users, per_user):
    rows = [{"instruction": f"what is {u} plus {k}?", "input": "", "output": f"the answer is {u + k}.",
             "user": f"patient-{u}"} for u in range(n_users) for k in range(per_user)]
    path.write_text(json.dumps(rows))
    return rows


def test_prismdp_train_user_level_counts_users_and_refuses_tasks_without_user_ids(tiny_llama_dir, tmp_path):
    data = tmp_path / "notes.json"
    _records(data, n_users=12, per_user=4)
    common = ["train", "--model", tiny_llama_dir, "--task", "instruct", "--data", str(data), "--steps", "3",
              "--batch-size", "3", "--micro-batch-size", "8", "--rank", "2", "--alpha", "4", "--max-length", "32",
              "--lr", "1e-3", "--quiet", "--epsilon", "3"]
    assert main([*common, "--privacy-unit", "user", "--user-id-column", "user", "--output", str(tmp_path / "u")]) == 0
    rep = json.loads((tmp_path / "u" / "privacy.json").read_text())
    assert rep["dataset_size"] == 12 and rep["privacy_unit"] == "user" and rep["sample_rate"] == pytest.approx(3 / 12)
    assert json.loads((tmp_path / "u" / "config.json").read_text())["data_notes"]["users"] == 12
    sizes = [json.loads(x)["batch_size"] for x in (tmp_path / "u" / "metrics.jsonl").read_text().splitlines()]
    assert all(n % 4 == 0 for n in sizes)  # whole users: 4 examples each
    # the same data at example level counts examples
    assert main([*common, "--output", str(tmp_path / "e")]) == 0
    assert json.loads((tmp_path / "e" / "privacy.json").read_text())["dataset_size"] == 48
    # a user column that some record lacks, and a task without user ids, are refused before training
    rows = json.loads(data.read_text())
    del rows[5]["user"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(rows))
    assert main([*common[:6], str(bad), *common[7:], "--privacy-unit", "user", "--user-id-column", "user",
                 "--output", str(tmp_path / "b")]) == 2
    assert main(["train", "--model", tiny_llama_dir, "--privacy-unit", "user", "--output", str(tmp_path / "c"),
                 "--quiet"]) == 2
    assert not (tmp_path / "b" / "privacy.json").exists()


def test_thirty_examples_of_one_user_are_one_clipped_unit_in_a_causal_lm():
    """backward(groups=...) on a causal LM (the path prismdp train takes for users): 30 examples of one user make one
    clipped contribution (the bound on its norm is tests/test_hf_trainer.py's user-level sensitivity test)."""
    from prismdp.engine import make_private
    from prismdp.losses import causal_lm_losses
    from helpers import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama()
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj", "v_proj"]))
    private = make_private(model, method="prism", lr=1e-3, dataset_size=10, batch_size=2, steps=1,
                           noise_multiplier=1.0, max_grad_norm=0.01, seed=0)
    ids = torch.randint(3, 90, (30, 12))
    groups = torch.zeros(30, dtype=torch.long)  # one user owns all 30 examples
    private.backward(causal_lm_losses(model(input_ids=ids).logits, ids), groups=groups)
    stats = private.mechanism.clip.stats()
    assert stats["batch_size"] == 1 and stats["clip_fraction"] == 1.0  # one unit, clipped
