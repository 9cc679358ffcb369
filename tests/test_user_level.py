"""User-level privacy in `prismdp train` (--privacy-unit user --user-id-column COL): users are Poisson-sampled,
each user's examples stay in one micro-batch, the accountant counts users."""

import json
import math

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
              "--batch-size", "3", "--micro-batch-size", "8", "--rank", "2", "--alpha", "4", "--max-length", "64",
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


def test_private_trainer_samples_whole_users_and_clips_each_user_to_C(tmp_path):
    """PrivateTrainer with privacy_unit="user", end to end, observed from outside: the rows each step trains on (as
    the data collator receives them) are the rows of whole users, a user's rows never split across micro-batches;
    over 30 steps every user is trained on (users, not row indices, are sampled); the logged batch size counts
    users; and the clipped sum of each step (the release minus its noise, from a step hook) has norm at most
    C x (users in the step), although one user owns 30 identical rows (clipped one by one they would add up to 30 C).
    Users are interleaved over the rows and of unequal sizes, so user ids read as row indices, contiguous blocks or
    per-example clipping all fail here."""
    from transformers import TrainerCallback, TrainingArguments

    from helpers import tiny_bert_cls
    from prismdp.data.collate import pad_collate
    from prismdp.integrations.hf import PrivacyArguments, PrivateTrainer

    g = torch.Generator().manual_seed(0)
    sizes = [1, 2, 3, 4, 5, 6, 7, 8, 2, 3, 4]  # users 0..10, then user 11 owns 30 copies of one row
    owners = [u for u, s in enumerate(sizes) for _ in range(s)] + [11] * 30
    owners = [owners[i] for i in torch.randperm(len(owners), generator=g).tolist()]  # users interleaved over rows
    big = [torch.randint(1, 100, (9,), generator=g).tolist(), 1]
    rows = []
    for i, u in enumerate(owners):
        ids, label = big if u == 11 else (torch.randint(1, 100, (int(torch.randint(4, 12, (1,), generator=g)),),
                                                        generator=g).tolist(), i % 2)
        rows.append({"input_ids": ids, "labels": label, "user": u, "row": i})
    users_rows = {u: {i for i, o in enumerate(owners) if o == u} for u in range(12)}

    trainer = None
    seen: list[tuple[int, list[int]]] = []  # (step, rows of one micro-batch) as the collator receives them

    def collate(batch):
        assert "user" not in batch[0]  # the user column never reaches the model
        seen.append((trainer.state.global_step, [r["row"] for r in batch]))
        return pad_collate(batch, pad_token_id=0)

    C, sigma, steps = 1e-3, 1.0, 30
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, learning_rate=1e-3,
                             max_steps=steps, seed=3, lr_scheduler_type="constant", report_to=[], logging_steps=1,
                             save_strategy="no", remove_unused_columns=False, use_cpu=True, disable_tqdm=True)
    trainer = PrivateTrainer(model=tiny_bert_cls(), args=args, train_dataset=rows, data_collator=collate,
                             privacy_args=PrivacyArguments(method="dp-adamw", noise_multiplier=sigma,
                                                           per_sample_max_grad_norm=C, expected_batch_size=3,
                                                           privacy_unit="user", user_id_column="user"))
    b = trainer.private.dp.expected_batch_size
    norms: list[float] = []  # per step: the norm of the clipped sum

    def hook(record):
        signal = [v.double() * b - n.double() for v, n in zip(record.release.values, record.release.noise)]
        norms.append(math.sqrt(sum(float(s.square().sum()) for s in signal)))

    trainer.private.optimizer.attach_step_hook(hook)

    class Steps(TrainerCallback):  # the step boundaries, so that empty Poisson steps count too
        def on_step_begin(self, args, state, control, **kw):
            seen.append((state.global_step, None))

    trainer.add_callback(Steps())
    trainer.train()

    per_step: dict[int, list[list[int]]] = {}
    for step, micro in seen:
        per_step.setdefault(step, [])
        if micro is not None:
            per_step[step].append(micro)
    assert sorted(per_step) == list(range(steps)) and len(norms) == steps
    logged = [h["batch_size"] for h in trainer.state.log_history if "batch_size" in h]
    assert len(logged) == steps
    trained_users = set()
    for step in range(steps):
        trained = [i for micro in per_step[step] for i in micro]
        assert len(trained) == len(set(trained)), (step, trained)  # each row at most once per step
        users = {owners[i] for i in trained}
        for micro in per_step[step]:  # a user's rows all in one micro-batch: all of them or none
            for u in {owners[i] for i in micro}:
                assert users_rows[u] <= set(micro), (step, u, micro)
        assert set(trained) == set().union(*(users_rows[u] for u in users)), step
        assert logged[step] == len(users), (step, logged[step], users)  # one clipped unit per user
        assert norms[step] <= C * (len(users) + 1e-4), (step, norms[step], len(users))  # 1e-4 C: float32 release
        trained_users |= users
    assert trained_users == set(range(12))  # users are what is sampled (rate 1/4: all 12 within 30 steps)
    assert any(11 in {owners[i] for m in per_step[s] for i in m} for s in range(steps))  # the big user was trained
