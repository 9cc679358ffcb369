"""Host synchronisations per logical step, over the whole step of `prismdp train` and of PrivateTrainer (issue 30):
at most 2 (prismdp's own reads: the step's loss and its clipping statistics, one batched read each).

Counted on the CPU with bench.micro's HostSyncCounter as the stand-in for a GPU (it counts item/tolist/float/bool/...
on any tensor).  On the CPU some tensors are read that live on the host on every device; those reads are no device
synchronisation and are set apart by the function that makes them (:data:`HOST_SIDE`), as are the model's own reads
(transformers' attention-mask preparation: the same for any trainer, listed, not counted).  The mechanism runs with
``always_mask`` (the accelerator path: its CPU-only shortcut reads the coefficients, which is free on the CPU).
"""

import sys
from collections import Counter

import pytest
import torch

from bench.micro import SYNC_FUNCS, HostSyncCounter
from test_hf_trainer import _trainer

BUDGET = 2

#: (file fragment, function) of reads of host-resident tensors, with why they are not device synchronisations
HOST_SIDE = {
    ("prismdp/privacy/sampling.py", "__iter__"): "Poisson sampler: CPU generator, host indices on every device",
    ("prismdp/train/step.py", "host_list"): "the sampled indices (host) turned into a list",
    ("prismdp/integrations/hf.py", "__iter__"): "the sampled indices (host) handed to the Trainer",
    ("torch/optim/", ""): "torch's Adam keeps its step count on the CPU (capturable=False, the default)",
}
MODEL_SIDE = "transformers/"  # the model's own forward (e.g. sdpa mask checks): the same in any trainer


class StepSyncCounter(HostSyncCounter):
    """Counts host reads while ``on``, by site; reads of host-resident tensors and the model's own reads apart."""

    def __init__(self):
        super().__init__()
        self.on = False
        self.sites, self.host, self.model = Counter(), Counter(), Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.on and name in SYNC_FUNCS:
            frame = sys._getframe(1)
            while frame.f_code.co_filename.replace("\\", "/").endswith(("torch/_tensor.py", "torch/overrides.py")):
                frame = frame.f_back
            path, fn = frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name
            site = f"{path.rsplit('site-packages/', 1)[-1].rsplit('src/', 1)[-1]}:{frame.f_lineno} {name}"
            if any(part in path and fn.startswith(f) for part, f in HOST_SIDE):
                self.host[site] += 1
            elif MODEL_SIDE in path:
                self.model[site] += 1
            else:
                self.count += 1
                self.sites[site] += 1
        return func(*args, **(kwargs or {}))


def _per_step(marks: list[tuple[int, int]]) -> list[int]:
    return [end - start for start, end in marks]


@pytest.mark.parametrize("method,unit", [("prism", "example"), ("dp-adamw", "example"), ("prism", "user")])
def test_prismdp_train_reads_the_host_at_most_twice_per_logical_step(tiny_llama_dir, tmp_path, monkeypatch, method,
                                                                     unit):
    """Whole loop iterations of `prismdp train` (micro-batches, optimizer step, metrics record and its log line, the
    progress bar; checkpoint steps excluded: they copy the state to the host by design), each step several
    micro-batches of a causal LM with LoRA dropout 0.05 (the default job's compensation path); with user-level
    privacy, each micro-batch's units too."""
    import prismdp.train.loop as loop
    from test_cli import tiny_cfg
    from test_user_level import _records

    counter, starts = StepSyncCounter(), []
    inner = loop.backward_batch

    def marked(*args, **kwargs):  # one mark per loop iteration: the count between two marks is one whole step
        starts.append(counter.count)
        counter.on = True
        return inner(*args, **kwargs)

    def accelerator_path(run):
        run.private.mechanism.always_mask = True

    monkeypatch.setattr(loop, "backward_batch", marked)
    extra = dict(batch_size=32)
    if unit == "user":  # 24 users of 4 examples, 6 per step: about 3 micro-batches of 2 users
        _records(tmp_path / "notes.json", n_users=24, per_user=4)
        extra = dict(task="instruct", data=str(tmp_path / "notes.json"), privacy_unit="user", user_id_column="user",
                     batch_size=6, max_length=64)  # the prompts fit with their answers (32 would mask them all)
    cfg = tiny_cfg(tiny_llama_dir, tmp_path / "run", method=method, steps=4, micro_batch_size=8, dropout=0.05,
                   checkpoint_every=100, **extra)
    with counter:
        loop.train(cfg, progress=True, log=lambda *a: None, setup=accelerator_path)
    per_step = [b - a for a, b in zip(starts, starts[1:])]  # steps 1..3 (the last one runs into the evaluation)
    assert len(per_step) == 3
    assert max(per_step) <= BUDGET, (per_step, dict(counter.sites))
    assert sum(counter.host.values()) > 0  # the filter saw the host-side reads it sets apart


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_private_trainer_step_reads_the_host_at_most_twice(tiny_bert_dir, tmp_path, method):
    """PrivateTrainer's training step (its micro-batches) and its optimizer step (clip, noise, update): at most 2
    host reads per logical step (the Trainer's own loop reads the loss when it logs: its logging_steps)."""
    from prismdp.integrations.hf import PrivacyArguments

    trainer, _ = _trainer(tmp_path, tiny_bert_dir,
                          privacy=PrivacyArguments(method=method, target_epsilon=3.0, expected_batch_size=32))
    trainer.private.mechanism.always_mask = True
    counter, spans = StepSyncCounter(), []

    def counted(fn):
        def run(*args, **kwargs):
            start = counter.count
            counter.on = True
            try:
                return fn(*args, **kwargs)
            finally:
                counter.on = False
                spans.append(counter.count - start)
        return run

    trainer.training_step = counted(trainer.training_step)
    trainer.optimizer.step = counted(trainer.optimizer.step)
    with counter:
        trainer.train()
    per_step = [a + b for a, b in zip(spans[0::2], spans[1::2])]
    assert len(per_step) == 5 and len(spans) == 10
    assert max(per_step) <= BUDGET, (per_step, dict(counter.sites))
