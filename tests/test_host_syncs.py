"""Host synchronisations per logical step (issues 30 and 44): `prismdp train` reads the host once per logical step,
after the optimizer step is queued (:class:`prismdp.engine.StepReport`: the loss, the example count and the clipping
statistics in one read); PrivateTrainer's step reads nothing (the report is read when the Trainer logs).

Counted on the CPU with bench.micro's HostSyncCounter as the stand-in for a GPU (it counts item/tolist/float/bool/...
on any tensor).  On the CPU some tensors are read that live on the host on every device; those reads are no device
synchronisation and are set apart by the function that makes them (:data:`HOST_SIDE`), as are the model's own reads
(transformers' attention-mask preparation: the same for any trainer, listed, not counted).  The mechanism runs with
``always_mask`` (the accelerator path: its CPU-only shortcut reads the coefficients, which is free on the CPU).
Counted apart (``HostSyncCounter.status_reads``; no tensor is read in Python): ``torch.linalg.svd`` / ``eigh``'s own
status checks, a device synchronisation each on CUDA, one per kind for all stacks of a PRISM step
(tests/test_factorise.py, docs/gpu-readiness.md).
"""

import json
import sys
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from bench.micro import SYNC_FUNCS, HostSyncCounter
from test_hf_trainer import _targs, _trainer

#: (file fragment, function) of reads of host-resident tensors, with why they are not device synchronisations
HOST_SIDE = {
    ("prismdp/privacy/sampling.py", "__iter__"): "Poisson sampler: CPU generator, host indices on every device",
    ("prismdp/train/step.py", "host_list"): "the sampled indices (host) turned into a list",
    ("prismdp/integrations/hf.py", "__iter__"): "the sampled indices (host) handed to the Trainer",
    ("torch/optim/", ""): "torch's Adam keeps its step count on the CPU (capturable=False, the default)",
}
MODEL_SIDE = "transformers/"  # the model's own forward (e.g. sdpa mask checks): the same in any trainer


class StepSyncCounter(HostSyncCounter):
    """Counts host reads while ``on``, by site; reads of host-resident tensors and the model's own reads apart.
    Each counted read is also appended to ``events`` (where spies add their own marks)."""

    def __init__(self):
        super().__init__()
        self.on = False
        self.sites, self.host, self.model = Counter(), Counter(), Counter()
        self.events: list[str] = []

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
                self.events.append(f"read {site}")
        return func(*args, **(kwargs or {}))


@dataclass
class Recorded:
    """One `prismdp train` run seen from outside: per logical step (steps 1..3; the last one runs into the
    evaluation) its events in order ("micro": a micro-batch's losses computed, "update": the optimizer's step
    returned, "read ...": a host read), the micro-batches' (loss sum, examples) and clipping coefficients, and
    metrics.jsonl's records."""

    events: list[list[str]]
    loss_sums: list[list[tuple[torch.Tensor, int]]]
    coefs: list[list[torch.Tensor]]
    records: list[dict]
    sites: dict = field(default_factory=dict)


def _train_recorded(model_dir, out, method: str, unit: str = "example", max_grad_norm: float = 1.0,
                    plant: bool = False) -> Recorded:
    """`prismdp train` (4 steps of several micro-batches, a causal LM with LoRA dropout 0.05), with spies on the
    per-example loss, the clipping coefficients and the optimizer step.  ``plant``: one extra host read per
    micro-batch (``float(losses.sum())``), the break the one-read test must catch."""
    import prismdp.train.loop as loop
    from test_cli import tiny_cfg
    from test_user_level import _records

    counter, marks = StepSyncCounter(), []
    loss_sums: list[list[tuple[torch.Tensor, int]]] = []
    coefs: list[list[torch.Tensor]] = []
    inner = loop.backward_batch

    def marked(*args, **kwargs):  # one mark per loop iteration: the events between two marks are one whole step
        marks.append(len(counter.events))
        loss_sums.append([])
        coefs.append([])
        counter.on = True
        return inner(*args, **kwargs)

    def spies(run):
        run.private.mechanism.always_mask = True  # the accelerator path
        loss_fn, coefficients, opt = run.data.loss, run.private.mechanism.clip.coefficients, run.private.optimizer
        opt_step = opt.step

        def losses(*args):
            out = loss_fn(*args)
            counter.events.append("micro")
            loss_sums[-1].append((out.detach().sum().double(), out.numel()))  # the old loop's micro-batch sums
            if plant:
                float(out.sum())
            return out

        def coef_spy(sq_norms):
            coef = coefficients(sq_norms)
            coefs[-1].append(torch.where(torch.isfinite(sq_norms), coef, 2.0))  # 2: not finite, never "clipped"
            return coef

        def update(*args, **kwargs):
            result = opt_step(*args, **kwargs)
            counter.events.append("update")
            return result

        run.data.loss, run.private.mechanism.clip.coefficients, opt.step = losses, coef_spy, update

    extra = dict(batch_size=32)
    if unit == "user":  # 24 users of 4 examples, 6 per step: about 3 micro-batches of 2 users
        _records(out.parent / "notes.json", n_users=24, per_user=4)
        extra = dict(task="instruct", data=str(out.parent / "notes.json"), privacy_unit="user",
                     user_id_column="user", batch_size=6, max_length=64)  # the prompts fit with their answers
    cfg = tiny_cfg(model_dir, out, method=method, steps=4, micro_batch_size=8, dropout=0.05, checkpoint_every=100,
                   max_grad_norm=max_grad_norm, **extra)
    with pytest.MonkeyPatch.context() as mp, counter:
        mp.setattr(loop, "backward_batch", marked)
        loop.train(cfg, progress=True, log=lambda *a: None, setup=spies)
    events = [counter.events[a:b] for a, b in zip(marks, marks[1:])]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return Recorded(events, loss_sums[:3], coefs[:3], records[:3], dict(counter.sites))


def _one_read_after_the_update(events: list[str]) -> bool:
    """Exactly one host read in the step, and it after the optimizer step returned (and after every micro-batch)."""
    reads = [i for i, e in enumerate(events) if e.startswith("read")]
    return len(reads) == 1 and reads[0] > events.index("update") > max(i for i, e in enumerate(events) if e == "micro")


#: (method, privacy unit, clipping bound): bounds near the tiny Llama's per-unit norms (about 4.1 per example for both
#: methods, 0.23 per user), so that a step clips some units and not others
RUNS = [("prism", "example", 4.1), ("dp-adamw", "example", 4.1), ("prism", "user", 0.22)]


@pytest.fixture(scope="module", params=RUNS, ids=lambda p: f"{p[0]}-{p[1]}")
def recorded(request, tiny_llama_dir, tmp_path_factory) -> Recorded:
    return _train_recorded(tiny_llama_dir, tmp_path_factory.mktemp("run") / "run", *request.param)


def test_prismdp_train_reads_the_host_once_per_logical_step_after_the_update(recorded):
    """Whole loop iterations of `prismdp train` (micro-batches, optimizer step, metrics record and its log line, the
    progress bar; checkpoint steps excluded: they copy the state to the host by design), each step several
    micro-batches; with user-level privacy, each micro-batch's units too."""
    assert len(recorded.events) == 3
    for events in recorded.events:
        assert events.count("micro") >= 2, events  # several micro-batches per step: the per-micro-batch case is real
        assert _one_read_after_the_update(events), (events, recorded.sites)


def test_the_logged_loss_batch_size_and_clip_fraction_are_the_old_loops(recorded):
    """metrics.jsonl's loss, batch size and clip fraction equal, bit for bit, what the loop computed before its one
    read moved after the update: the float64 sum of the micro-batches' loss sums over the number of examples, and the
    fraction of clipped units from the clipping coefficients."""
    for record, micros, coefs in zip(recorded.records, recorded.loss_sums, recorded.coefs, strict=True):
        total = micros[0][0]
        for s, _ in micros[1:]:
            total = total + s
        examples = sum(n for _, n in micros)
        coef = torch.cat(coefs)  # one coefficient per privacy unit
        assert record["batch_size"] == examples
        assert record["loss"] == total.item() / examples
        assert record["clip_fraction"] == ((coef < 1.0).sum().double() / coef.numel()).item()
    assert any(0 < r["clip_fraction"] < 1 for r in recorded.records)  # the count is tested, not an all-or-nothing

def test_a_planted_read_per_micro_batch_breaks_the_one_read(tiny_llama_dir, tmp_path):
    """The check above catches one extra read per micro-batch (``float(losses.sum())`` in the micro-step)."""
    planted = _train_recorded(tiny_llama_dir, tmp_path / "run", "prism", plant=True)
    for events in planted.events:
        assert not _one_read_after_the_update(events)
        assert sum(e.startswith("read") for e in events) == 1 + events.count("micro")


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_a_whole_private_trainer_step_reads_nothing_from_the_host(tiny_bert_dir, tmp_path, method):
    """Whole iterations of PrivateTrainer's loop (from one optimizer step to the next: the Trainer's own loop, the
    training step's micro-batches, the private step) with no logging step among them make no host read, neither
    prismdp's nor the Trainer's (its logging_nan_inf_filter read the loss twice a step); the step's report is read
    when the Trainer logs.  The model's own mask checks are listed, not counted."""
    from prismdp.integrations.hf import PrivacyArguments

    trainer, _ = _trainer(tmp_path, tiny_bert_dir, targs=_targs(tmp_path, logging_steps=100),
                          privacy=PrivacyArguments(method=method, target_epsilon=3.0, expected_batch_size=32))
    trainer.private.mechanism.always_mask = True
    counter, marks = StepSyncCounter(), []
    step = trainer.optimizer.step

    def marked(*args, **kwargs):  # the reads between two marks are one whole iteration of the Trainer's loop
        out = step(*args, **kwargs)
        marks.append((sum(counter.sites.values()), sum(n for s, n in counter.model.items() if "/trainer" in s)))
        counter.on = True
        return out

    trainer.optimizer.step = marked
    with counter:
        trainer.train()
    assert len(marks) == 5
    assert marks[-1] == (0, 0), (dict(counter.sites), dict(counter.model))  # after 4 whole iterations


def test_the_stop_agreement_of_several_processes_is_read_with_the_step_report():
    """Under torchrun the training loop agrees on a stop request (the MAX of every rank's flag) once per step; the
    all-reduce is queued (World.queue_max) and its result read in the step's one read (StepReport.flags), where it
    was a read of its own (World.all_reduce_max: 2 reads a step, checked).  Run on a one-process gloo group in a
    subprocess (the test process keeps no process group)."""
    from helpers import run_python

    code = """if True:
        import tempfile, torch, torch.distributed as dist
        from bench.micro import HostSyncCounter
        from prismdp.distributed import World
        from prismdp.engine import StepReport
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        world = World()
        with HostSyncCounter() as counter:
            report = StepReport(totals=torch.tensor([3.0, 2.0], dtype=torch.float64),
                                flags={"stop": world.queue_max(1, "stop request")})
            out = report.read()
        print(counter.count, out["stop"], out["loss"], out["examples"])
        dist.destroy_process_group()
    """
    res = run_python(code, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["1", "1.0", "1.5", "2"], res.stdout
