"""prismdp inside the Hugging Face Trainer: one engine, two front ends (issue 13's checks)."""

import dataclasses
import functools
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

from helpers import net_batch, tiny_net
from prismdp.data.collate import pad_collate
from prismdp.integrations.hf import PrivacyArguments, PrivateTrainer, per_example_losses

torch.set_num_threads(1)


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _setup(model_dir, seed=3, **cfg_kw):
    """prismdp's own model and data for a TrainConfig (the same objects `prismdp train` builds)."""
    from prismdp.models import load_model
    from prismdp.train.build import build_lora_model
    from prismdp.train.config import TrainConfig
    from prismdp.train.tasks import build_task_data

    cfg = TrainConfig(model=model_dir, task="synthetic", synthetic_train=96, synthetic_test=16, steps=5, batch_size=16,
                      micro_batch_size=8, rank=4, alpha=8, lr=1e-2, max_length=24, seed=seed, dropout=0.0,
                      group_by_length=False, **cfg_kw)
    torch.manual_seed(cfg.seed)
    model, tok = load_model(cfg.model, "seq_cls", 2)
    data = build_task_data(cfg, tok)
    model, _, _ = build_lora_model(cfg, model, "seq_cls")
    return cfg, model, tok, data


def _targs(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, learning_rate=1e-2, max_steps=5, seed=3,
                lr_scheduler_type="constant", report_to=[], logging_steps=1, save_strategy="no",
                remove_unused_columns=False, use_cpu=True, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


def _trainer(tmp_path, model_dir, privacy=None, targs=None, **setup_kw):
    cfg, model, tok, data = _setup(model_dir, **setup_kw)
    privacy = privacy or PrivacyArguments(target_epsilon=3.0, expected_batch_size=16)
    return PrivateTrainer(model=model, args=targs or _targs(tmp_path), privacy_args=privacy,
                          train_dataset=Rows(data.train),
                          data_collator=functools.partial(pad_collate, pad_token_id=tok.pad_token_id)), cfg


class FixedBatches:
    """A fixed schedule of logical batches in place of the Poisson sampler, this rank's share (the indices = rank mod
    world, as PoissonSampler shards): one and two processes then train on the same examples at every step."""

    def __init__(self, batches: list[list[int]], rank: int = 0, world: int = 1):
        self.batches, self.rank, self.world, self.step = batches, rank, world, 0

    def __iter__(self):
        while self.step < len(self.batches):
            self.step += 1
            yield torch.tensor([i for i in self.batches[self.step - 1] if i % self.world == self.rank],
                               dtype=torch.long)

    def describe(self) -> dict[str, str]:  # the privacy report's sampling_source
        return {"generator": "none: a fixed schedule (test)", "inclusion": "fixed"}


def fixed_batches(steps: int, n: int = 96, rate: float = 0.2, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nonzero(torch.rand(n, generator=g) < rate).flatten().tolist() for _ in range(steps)]


def float64_trainer(model_dir, out, steps: int, method: str, rank: int = 0, world: int = 1, **targs_kw):
    """A float64 PrivateTrainer without dropout on fixed logical batches (this rank's share of each), sigma 1 from
    the seeded shared noise stream: the trajectory of one process and of ``world`` processes agree to round-off."""
    cfg, model, tok, data = _setup(model_dir)
    model.double()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    trainer = PrivateTrainer(model=model, args=_targs(out, max_steps=steps, **targs_kw),
                             privacy_args=PrivacyArguments(method=method, noise_multiplier=1.0, expected_batch_size=16),
                             train_dataset=Rows(data.train),
                             data_collator=functools.partial(pad_collate, pad_token_id=tok.pad_token_id))
    trainer.private.data_sampler = FixedBatches(fixed_batches(steps), rank, world)
    return trainer


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_trainer_and_prismdp_train_follow_one_trajectory_and_write_one_privacy_report(tiny_bert_dir, tmp_path, method):
    """The same seed, data and settings through `prismdp train` and through PrivateTrainer: the same adapter weights
    after 5 private steps (bitwise: one engine, the same operations) and the same privacy.json."""
    from prismdp.train.loop import train

    trainer, cfg = _trainer(tmp_path / "hf", tiny_bert_dir,
                            privacy=PrivacyArguments(method=method, target_epsilon=3.0, expected_batch_size=16))
    trainer.train()
    trainer.save_model()
    res = train(dataclasses.replace(cfg, method=method, output=str(tmp_path / "cli")), progress=False,
                log=lambda *a: None)
    ours = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    theirs = {n: p for n, p in res.model.named_parameters() if p.requires_grad}
    assert ours.keys() == theirs.keys()
    for n in ours:
        assert torch.equal(ours[n], theirs[n]), n
    report = json.loads((tmp_path / "hf" / "privacy.json").read_text())
    assert report == json.loads((tmp_path / "cli" / "privacy.json").read_text()) == trainer.privacy_report()
    assert report["steps"] == 5 and 0 < report["epsilon"] <= 3.0
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 5 and all({"epsilon", "noise_multiplier", "clip_fraction"} <= h.keys() for h in logged)
    assert logged[-1]["epsilon"] == pytest.approx(report["epsilon"])
    # the saved adapter is PRISM's export for the original base model (rank 2r), loadable by stock PEFT
    adapter = json.loads((tmp_path / "hf" / "adapter_config.json").read_text())
    assert adapter["r"] == (8 if method == "prism" else 4)


def test_resume_from_a_trainer_checkpoint_equals_an_uninterrupted_run(tiny_bert_dir, tmp_path):
    full, _ = _trainer(tmp_path / "full", tiny_bert_dir, targs=_targs(tmp_path / "full", max_steps=6))
    full.train()
    part, _ = _trainer(tmp_path / "part", tiny_bert_dir,
                       targs=_targs(tmp_path / "part", max_steps=6, save_strategy="steps", save_steps=3))
    part.control.should_training_stop = False
    # interrupt after the checkpoint at step 3: a callback stops the run there
    from transformers import TrainerCallback

    class StopAt3(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                control.should_training_stop = True

    part.add_callback(StopAt3())
    part.train()
    resumed, _ = _trainer(tmp_path / "part", tiny_bert_dir,
                          targs=_targs(tmp_path / "part", max_steps=6, save_strategy="steps", save_steps=3))
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-3"))
    a = [p for p in full.model.parameters() if p.requires_grad]
    b = [p for p in resumed.model.parameters() if p.requires_grad]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert resumed.privacy_report() == full.privacy_report()
    assert resumed.private.budget.steps_taken == 6


def test_poisson_logical_batches_have_the_right_size_law_and_empty_ones_happen(tiny_bert_dir, tmp_path):
    trainer, _ = _trainer(tmp_path, tiny_bert_dir, privacy=PrivacyArguments(noise_multiplier=1.0,
                                                                           expected_batch_size=2),
                          targs=_targs(tmp_path, max_steps=3000))
    sizes = torch.tensor([len(b["prismdp_units"]) for b in trainer.get_train_dataloader()], dtype=torch.float64)
    N, q = 96, 2 / 96
    assert len(sizes) == 3000
    mean_se = math.sqrt(N * q * (1 - q) / len(sizes))
    assert abs(float(sizes.mean()) - N * q) < 4 * mean_se
    assert float(sizes.var()) == pytest.approx(N * q * (1 - q), rel=0.12)  # binomial(N, q)
    assert int((sizes == 0).sum()) > 200  # P(empty) = (1 - q)^N = 0.13


def test_per_example_causal_lm_losses_do_not_depend_on_the_other_examples_under_padding():
    from helpers import padded_batch, tiny_llama

    model = tiny_llama().eval()
    ids, mask = padded_batch([9, 4, 7], vocab=100)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100  # a prompt
    with torch.no_grad():
        batch = per_example_losses(model(input_ids=ids, attention_mask=mask).logits, labels)
        for i in range(3):
            L = int(mask[i].sum())
            alone = per_example_losses(model(input_ids=ids[i:i + 1, :L]).logits, labels[i:i + 1, :L])
            torch.testing.assert_close(batch[i], alone[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change, message", [
    (dict(train_sampling_strategy="group_by_length"), "group_by_length .* changes which examples form a batch"),
    (dict(auto_find_batch_size=True), "a retried step would spend privacy twice"),
    (dict(gradient_accumulation_steps=4), "leave gradient_accumulation_steps at 1"),
    (dict(dataloader_drop_last=True), "dataloader_drop_last drops examples"),
])
def test_trainer_settings_that_break_the_accounting_are_refused(tiny_bert_dir, tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        _trainer(tmp_path, tiny_bert_dir, targs=_targs(tmp_path, **change))


def test_iterable_datasets_and_lossy_collators_are_refused(tiny_bert_dir, tmp_path):
    cfg, model, tok, data = _setup(tiny_bert_dir)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(data.train)

    with pytest.raises(ValueError, match="an IterableDataset .* cannot be Poisson-sampled"):
        PrivateTrainer(model=model, args=_targs(tmp_path), train_dataset=Stream(),
                       privacy_args=PrivacyArguments(target_epsilon=3.0, expected_batch_size=16))
    drop_one = lambda rows: pad_collate(rows[:-1], tok.pad_token_id)  # noqa: E731
    trainer = PrivateTrainer(model=model, args=_targs(tmp_path), train_dataset=Rows(data.train),
                             data_collator=drop_one,
                             privacy_args=PrivacyArguments(target_epsilon=3.0, expected_batch_size=16))
    with pytest.raises(ValueError, match="must keep every example"):
        trainer.train()
    for bad, message in ((dict(), "exactly one of them"), (dict(target_epsilon=3.0, noise_multiplier=1.0),
                                                           "exactly one of them"),
                         (dict(noise_multiplier=1.0, privacy_unit="user"), "needs user_id_column"),
                         (dict(noise_multiplier=1.0, method="sgd"), "unknown method")):
        with pytest.raises(ValueError, match=message):
            PrivacyArguments(**bad)


def test_privacy_arguments_parse_from_the_command_line():
    from transformers import HfArgumentParser

    targs, pargs = HfArgumentParser((TrainingArguments, PrivacyArguments)).parse_args_into_dataclasses(
        ["--output_dir", "x", "--target_epsilon", "6", "--expected_batch_size", "128", "--method", "dp-adamw",
         "--accountant", "rdp", "--use_cpu"])
    assert pargs.target_epsilon == 6.0 and pargs.expected_batch_size == 128 and pargs.method == "dp-adamw"


def test_user_level_release_moves_by_at_most_C_when_a_50_example_user_leaves():
    """Units of several examples: a user owning 50 (adversarially scaled) examples changes the clipped sum by at most
    C; PRISM and DP-AdamW (the per-user mean of the user's gradients, clipped once)."""
    from prismdp.engine import make_private
    from prismdp.losses import classification_losses

    C = 0.02
    X, Y = net_batch(80, seed=2)
    X[:50] *= 3  # the big user
    users = [list(range(50))] + [[50 + 3 * k + j for j in range(3)] for k in range(10)]
    for method in ("prism", "dp-adamw"):
        sums = []
        for present in (users, users[1:]):
            model = tiny_net(seed=1)
            private = make_private(model, method=method, lr=1e-2, dataset_size=11, batch_size=4, steps=1,
                                   noise_multiplier=1.0, max_grad_norm=C, seed=0)
            private.mechanism.dp = dataclasses.replace(private.mechanism.dp, noise_multiplier=0.0,
                                                       expected_batch_size=1.0)
            idx = [i for u in present for i in u]
            groups = [g for g, u in enumerate(present) for _ in u]
            private.backward(classification_losses(model(X[idx]), Y[idx]), groups=torch.tensor(groups))
            assert private.mechanism.clip.stats()["batch_size"] == len(present)  # one clipped unit per user
            sums.append([s.clone() for s in private.mechanism.sums])
        if method == "prism":
            from prismdp import geometry
            from prismdp.lora import get_factors

            opt = private.optimizer
            opt._ensure_frames()
            diffs = [a - b for a, b in zip(*sums)]
            lifted = opt._coordinates().signal(diffs)
            sq = 0.0
            for k, (dA, dB) in enumerate(opt.per_pair(lifted[:2 * len(opt.stacks)])):
                sq += float(geometry.tangent_norm_sq(*get_factors(private.pairs[k], torch.float64), dA.double(),
                                                      dB.double()))
            sq += sum(float(d.square().sum()) for d in lifted[2 * len(opt.stacks):])
            dist = math.sqrt(sq)
        else:
            dist = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(*sums)))
        assert 0.9 * C < dist <= C * (1 + 1e-5), (method, dist)  # the big user is clipped to C exactly


def test_user_level_trainer_accounts_users_not_examples(tiny_bert_dir, tmp_path):
    cfg, model, tok, data = _setup(tiny_bert_dir)
    rows = [{**r, "user": i % 12} for i, r in enumerate(data.train)]  # 12 users of 8 examples
    collate = lambda rs: pad_collate([{k: v for k, v in r.items() if k != "user"} for r in rs], tok.pad_token_id)  # noqa
    trainer = PrivateTrainer(model=model, args=_targs(tmp_path, max_steps=3), train_dataset=Rows(rows),
                             data_collator=collate,
                             privacy_args=PrivacyArguments(target_epsilon=3.0, expected_batch_size=3,
                                                           privacy_unit="user", user_id_column="user"))
    trainer.train()
    rep = trainer.privacy_report()
    assert rep["dataset_size"] == 12 and rep["privacy_unit"] == "user"
    assert rep["sample_rate"] == pytest.approx(3 / 12)
    sizes = [h["batch_size"] for h in trainer.state.log_history if "batch_size" in h]
    assert all(s == int(s) and s <= 12 for s in sizes)  # clipped units are users


def _run_example(module_path, argv):
    import importlib.util

    spec = importlib.util.spec_from_file_location(module_path.stem, module_path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(argv)


@pytest.mark.parametrize("example", ["hf_trainer_math10k.py", "trl_sft_math10k.py"])
def test_the_examples_run_private_and_export(example, tiny_llama_dir, tmp_path, shared_data):
    """examples/: PrivateTrainer with a stock collator, and TRL's SFTTrainer made private (TRL prepares the data,
    prismdp samples, clips and accounts), on a tiny Llama with the SmolLM2 tokenizer, 3 steps."""
    from pathlib import Path

    pytest.importorskip("trl")
    script = Path(__file__).resolve().parents[1] / "examples" / example
    out = tmp_path / "out"
    argv = ["--data", str(shared_data / "math" / "math_10k.json"), "--model", tiny_llama_dir, "--output_dir", str(out),
            "--max_steps", "3", "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--use_cpu",
            "--target_epsilon", "6", "--expected_batch_size", "8", "--report_to", "none", "--save_strategy", "no",
            "--examples", "64", "--max_length", "96", "--logging_steps", "1", "--rank", "4"]
    trainer = _run_example(script, argv)
    report = json.loads((out / "privacy.json").read_text())
    assert report["steps"] == 3 and 0 < report["epsilon"] <= 6.0 and report == trainer.privacy_report()
    assert report["dataset_size"] == len(trainer.train_dataset)
    assert (out / "adapter_model.safetensors").is_file()
    if example.startswith("trl"):
        from trl import SFTConfig

        from prismdp.integrations.hf import private_trainer_class
        from trl import SFTTrainer

        with pytest.raises(ValueError, match="packing / padding_free join several examples"):
            private_trainer_class(SFTTrainer)(model=trainer.model, args=SFTConfig(output_dir=str(tmp_path / "p"),
                                                                                   packing=True, use_cpu=True,
                                                                                   bf16=False),
                                              train_dataset=trainer.train_dataset,
                                              privacy_args=PrivacyArguments(target_epsilon=3.0, expected_batch_size=8))


def test_private_trainer_under_torchrun_follows_the_one_process_trajectory(tiny_bert_dir, tmp_path):
    """`torchrun --nproc-per-node 2` of a PrivateTrainer script (tests/hf_dist_worker.py; PRISM, then DP-AdamW) against
    one process, both in float64 on the same fixed logical batches (each rank its share): the trained tensors equal
    the one-process run's to 1e-10 (summation order only) and are bitwise the same on both ranks; the privacy report
    is the same (world_size aside); and no DDP all-reduce touches the gradients the mechanism discards (each rank's
    .grad after a backward is its own examples' gradient: they differ between the ranks).  Bounded: a collective waits
    at most 60 s and the whole launch 300 s, after which torchrun and both workers are killed and the test fails
    (helpers.Spawned)."""
    from helpers import torchrun

    from hf_dist_worker import STEPS

    methods = ("prism", "dp-adamw")
    per_rank = [[math.ceil(sum(i % 2 == r for i in b) / 8) for r in (0, 1)] for b in fixed_batches(STEPS)]
    assert any(a != b for a, b in per_rank)  # the ranks run different numbers of micro-batches at some step
    res = torchrun(2, [str(Path(__file__).parent / "hf_dist_worker.py"), tiny_bert_dir, str(tmp_path / "two"),
                       ",".join(methods)], tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    for method in methods:
        one = float64_trainer(tiny_bert_dir, tmp_path / "one" / method, STEPS, method)
        start = [p.detach().clone() for p in one.model.parameters() if p.requires_grad]
        one.train()
        out = tmp_path / "two" / method
        r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
        assert r0["world_size"] == r1["world_size"] == 2 and r0["steps"] == r1["steps"] == STEPS
        assert r0["grads"] and r1["grads"] and r0["grads"][0] != r1["grads"][0]
        t0, t1 = (torch.load(out / f"rank{r}.pt") for r in (0, 1))
        mine = [p.detach() for p in one.model.parameters() if p.requires_grad]
        assert len(t0) == len(t1) == len(mine) == len(start)
        assert max(float((m - s).abs().max()) for m, s in zip(mine, start)) > 1e-3  # it trained
        for a, b, m in zip(t0, t1, mine):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, m, rtol=1e-10, atol=1e-10)
        report = json.loads((out / "privacy.json").read_text())
        theirs = one.privacy_report()
        assert report.pop("world_size") == 2 and theirs.pop("world_size") == 1
        assert report == theirs, method


def test_epochs_become_logical_steps_and_the_scheduler_steps_once_per_logical_step(tiny_bert_dir, tmp_path):
    """num_train_epochs with the expected batch: 2 epochs of 96 examples at 16 = 12 logical steps, sigma calibrated
    for exactly 12; a linear schedule decays once per logical step (not per micro-batch); max_steps changed after
    the calibration is refused before anything trains."""
    from prismdp.privacy import calibrate_sigma

    trainer, _ = _trainer(tmp_path, tiny_bert_dir, targs=_targs(tmp_path, max_steps=-1, num_train_epochs=2,
                                                                 lr_scheduler_type="linear", learning_rate=1.2e-2))
    assert trainer.args.max_steps == 12
    assert trainer.private.dp.noise_multiplier == pytest.approx(calibrate_sigma(3.0, 1e-5, 16 / 96, 12), rel=1e-12)
    seen = []
    step = trainer.private.queue_step

    def recording_step(*args):  # the rate each private step used
        seen.append(trainer.private.optimizer.param_groups[0]["lr"])
        return step(*args)

    trainer.private.queue_step = recording_step
    trainer.train()
    assert trainer.state.global_step == 12 and trainer.privacy_report()["steps"] == 12
    assert seen == pytest.approx([1.2e-2 * (1 - k / 12) for k in range(12)], rel=1e-9)
    late, _ = _trainer(tmp_path / "late", tiny_bert_dir, targs=_targs(tmp_path / "late", max_steps=3))
    late.args.max_steps = 5
    with pytest.raises(ValueError, match="sigma was calibrated .* for 3 steps"):
        late.train()
    assert late.private.budget.steps_taken == 0


def test_per_example_losses_under_a_stock_collator_with_padding_and_label_masking(tiny_llama_dir):
    """DataCollatorForSeq2Seq pads inputs and labels (-100) to the longest example: each example's loss in the padded
    micro-batch equals its loss alone, so no example's gradient depends on another's length."""
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq

    from helpers import tiny_llama

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = tiny_llama().eval()
    g = torch.Generator().manual_seed(0)
    rows = []
    for length, prompt in ((9, 3), (4, 1), (7, 5)):
        ids = torch.randint(5, 90, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": [-100] * prompt + ids[prompt:]})
    collate = DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)
    batch = collate([dict(r) for r in rows])
    assert batch["input_ids"].shape == (3, 9) and int((batch["labels"] == -100).sum()) > 9
    with torch.no_grad():
        together = per_example_losses(model(input_ids=batch["input_ids"],
                                            attention_mask=batch["attention_mask"]).logits, batch["labels"])
        for i, r in enumerate(rows):
            alone = collate([dict(r)])
            loss = per_example_losses(model(input_ids=alone["input_ids"]).logits, alone["labels"])
            torch.testing.assert_close(together[i], loss[0], rtol=1e-5, atol=1e-6)


def test_trl_example_splits_prompt_and_completion_at_a_token_boundary(tiny_llama_dir, shared_data):
    """TRL needs tokenize(prompt) to be a prefix of tokenize(prompt + completion), else it drops the prompt's tail
    from the training context. The LLM-Adapters prompt ends in indentation that merges with the answer's first
    token; the example's split keeps the exact text and the prefix property (the naive split does not)."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoTokenizer

    from prismdp.data import generate_prompt, load_instruct_json

    pytest.importorskip("trl")
    path = Path(__file__).resolve().parents[1] / "examples" / "trl_sft_math10k.py"
    spec = importlib.util.spec_from_file_location("trl_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)

    def is_prefix(prompt, completion):
        a, b = tok(prompt)["input_ids"], tok(prompt + completion)["input_ids"]
        return b[:len(a)] == a

    records = load_instruct_json(shared_data / "math" / "math_10k.json")[:20]
    naive = [(generate_prompt({**r, "output": ""}), r["output"]) for r in records]
    assert not all(is_prefix(p, c) for p, c in naive)
    for (p, c), r in zip(naive, records):
        row = example.split_at_token_boundary(p, c)
        assert row["prompt"] + row["completion"] == generate_prompt(r)
        assert is_prefix(row["prompt"], row["completion"])


def test_examples_dropped_by_trl_preparation_are_counted_in_a_warning(tiny_llama_dir, tmp_path):
    """TRL's SFTTrainer drops, silently, the examples whose completion max_length cuts off entirely. The private
    Trainer warns with the count (here the three rows whose prompt alone is ~4x max_length) and accounts only the
    rows kept; with every completion inside max_length there is no warning."""
    import warnings

    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from prismdp.integrations.hf import private_trainer_class

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    short = [{"prompt": f"Question {i}: what is {i} plus {i}?", "completion": f" {2 * i}"} for i in range(5)]
    long = [{"prompt": "Read this. " + "The quick brown fox jumps over the lazy dog. " * 12 + "Answer:",
             "completion": " yes"} for _ in range(3)]
    assert all(len(tok(r["prompt"])["input_ids"]) < 20 for r in short)
    assert all(len(tok(r["prompt"])["input_ids"]) > 100 for r in long)

    def build(rows):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama_dir),
                               LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        args = SFTConfig(output_dir=str(tmp_path), max_length=32, per_device_train_batch_size=2, max_steps=2,
                         use_cpu=True, bf16=False, report_to=[], save_strategy="no", disable_tqdm=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = private_trainer_class(SFTTrainer)(
                model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                privacy_args=PrivacyArguments(target_epsilon=3.0, expected_batch_size=2))
        return trainer, [str(w.message) for w in caught if "data preparation kept" in str(w.message)]

    trainer, messages = build(short + long)
    assert len(trainer.train_dataset) == 5 and trainer.privacy_report()["dataset_size"] == 5
    assert len(messages) == 1 and "kept 5 of the 8 training examples given (3 dropped" in messages[0]
    trainer, messages = build(short)
    assert len(trainer.train_dataset) == 5 and messages == []


def _per_example_grads(tmp_path, model_dir, **targs_kw):
    """Two private steps of a dropout-free PrivateTrainer; per micro-batch, the per-example gradients the mechanism
    received (every LoRA factor, A and B), read where the engine collects them; and the dtype of a frozen layer's
    output (what precision the forward ran in) and how often that layer ran."""
    trainer, _ = _trainer(tmp_path, model_dir, privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=16),
                          targs=_targs(tmp_path, max_steps=2, **targs_kw))
    for m in trainer.model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    grads, forwards = [], []
    collect = trainer.private.grad_sampler.collect

    def recording_collect():  # test instrumentation: the per-example gradients handed to the mechanism
        got = collect()
        factors = [t.detach().clone() for pair in got.lora for t in pair if t is not None]
        grads.append((trainer.state.global_step, factors))
        return got

    trainer.private.grad_sampler.collect = recording_collect
    layer = trainer.model.base_model.model.bert.encoder.layer[0].intermediate
    layer.register_forward_hook(lambda m, i, out: forwards.append(out.dtype))
    trainer.train()
    return grads, forwards


def _relative_errors(got: list, want: list, steps: int = 2) -> torch.Tensor:
    """Per example and per factor: |g - g_ref| / |g_ref| (Frobenius), over every micro-batch of the first ``steps``
    steps."""
    assert [step for step, _ in got] == [step for step, _ in want]  # the same micro-batches
    errs = []
    for (step, mb_got), (_, mb_want) in zip(got, want):
        if step >= steps:
            continue
        for g, w in zip(mb_got, mb_want):
            errs.append((g.double() - w.double()).flatten(1).norm(dim=1) / w.double().flatten(1).norm(dim=1))
    return torch.cat(errs)


def test_bf16_trainer_per_example_gradients_match_float32_to_bf16_precision(tiny_bert_dir, tmp_path):
    """TrainingArguments(bf16=True) on the CPU (autocast: the frozen layers run in bfloat16): the per-example gradients
    of the first step's micro-batches are float32 (never accumulated in half precision) and equal the float32 run's
    to bf16 precision: each example's factor gradient within 6 % (Frobenius, relative), 2 % on average.  bf16 keeps 8
    significant bits (unit round-off 2^-9 = 0.2 %); two layers of forward and backward in bf16 give ~1 % here (observed:
    0.7 % on average, 3.5 % for the worst example and factor); the gradients must differ (bf16 really ran)."""
    want, f32 = _per_example_grads(tmp_path / "f32", tiny_bert_dir)
    got, bf16 = _per_example_grads(tmp_path / "bf16", tiny_bert_dir, bf16=True)
    assert set(f32) == {torch.float32} and set(bf16) == {torch.bfloat16}
    assert all(g.dtype == torch.float32 for _, mb in got for g in mb)
    err = _relative_errors(got, want, steps=1)  # step 2 starts from slightly different weights
    assert 1e-4 < float(err.mean()) < 0.02 and float(err.max()) < 0.06, err


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_trainer_per_example_gradients_match_the_plain_run(tiny_bert_dir, tmp_path, reentrant):
    """TrainingArguments(gradient_checkpointing=True), torch's non-re-entrant and re-entrant modes: the layers really
    run twice (forward, then recomputed in the backward pass) and the per-example gradients of every micro-batch of
    both steps equal the plain run's to float32 round-off (relative 1e-5 per example; observed: bitwise equal)."""
    want, plain = _per_example_grads(tmp_path / "plain", tiny_bert_dir)
    got, ckpt = _per_example_grads(tmp_path / "ckpt", tiny_bert_dir, gradient_checkpointing=True,
                                   gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert len(ckpt) == 2 * len(plain)  # recomputed: checkpointing is on
    assert len(got) >= 2
    assert float(_relative_errors(got, want).max()) < 1e-5
