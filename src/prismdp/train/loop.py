"""The training run behind ``prismdp train``: load, make private, train on Poisson batches, evaluate, export.

Outputs in ``cfg.output``: ``config.json`` (resolved), ``metrics.jsonl`` (one record per step), ``checkpoint.pt``
(resumable), ``adapter/`` (stock PEFT, for the original base model), ``privacy.json``, ``eval.json`` (per eval set;
causal-LM tasks are evaluated by greedy generation on ``eval_tasks``, with the generations in ``generations/``)
and ``summary.json`` (privacy, eval and any ``eval_missing`` sets; ``prismdp experiment`` reads its Table-2 columns
from eval: :mod:`prismdp.experiment.columns`).
Every file is written atomically.  The per-step loss and clip fraction in ``metrics.jsonl`` are computed on the
private training data and are *not* covered by the DP guarantee: keep them with the data.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import code_version
from ..atomic import atomic_path, write_json, write_text
from ..distributed import init_from_env
from ..export import export_adapter
from ..privacy import report_steps
from .build import build_run
from .config import ConfigError, TrainConfig
from .profile import PeakMemory, run_step_times
from .step import backward_batch
from .tasks import evaluate_classification

__all__ = ["train", "TrainResult", "RunExistsError"]

# Keys that may differ between an interrupted run and its resumption.
_RESUMABLE_DIFFS = {"output"}


class RunExistsError(RuntimeError):
    """The output folder already holds a run."""


@dataclass
class TrainResult:
    summary: dict  # what summary.json holds; {"interrupted_at": step} for a stopped run
    model: torch.nn.Module  # the trained PEFT model (on the compensated base weights)
    tokenizer: object


def _save_torch(path: Path, obj) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def _checkpoint(private, step: int, cfg: TrainConfig) -> dict:
    return {"step": step, "config": cfg.to_dict(), "private": private.state_dict()}


def _check_resume(cfg: TrainConfig, ckpt: dict) -> None:
    saved = ckpt["config"]
    diffs = {k: (saved.get(k), v) for k, v in cfg.to_dict().items() if saved.get(k) != v and k not in _RESUMABLE_DIFFS}
    if diffs:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diffs.items())
        raise ConfigError(f"--resume with a different configuration ({detail}); resume with the original settings")


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="train", unit="step", dynamic_ncols=True)


REPLICA_CHECK_EVERY = 10  # multi-process runs compare the ranks' trained tensors this often (and at checkpoints)


def train(cfg: TrainConfig, *, resume: bool = False, stop_after: int | None = None, progress: bool = True,
          log=print, setup=None, extend_data=None) -> TrainResult:
    """Run (or resume) one training job; returns the final summary (privacy report and evaluation).

    ``setup(run)`` is called with the built :class:`~prismdp.train.build.Run` before the first step (observers attach
    their hooks there, e.g. the audit's canaries); ``extend_data`` goes to :func:`~prismdp.train.build.build_run`.

    Under ``torchrun`` (or in an initialised process group) every process runs this with the same configuration: they
    train one private run together (:mod:`prismdp.distributed`); rank 0 alone writes files, shows progress and
    evaluates."""
    world = init_from_env()
    main = world is None or world.main
    if not main:
        progress, log = False, (lambda *a, **k: None)
    out = Path(cfg.output)
    ckpt_path, metrics_path = out / "checkpoint.pt", out / "metrics.jsonl"
    ckpt = None
    if resume:
        if not ckpt_path.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}; start the run without --resume")
        ckpt = torch.load(ckpt_path, weights_only=False)
        _check_resume(cfg, ckpt)
    elif main and (ckpt_path.exists() or metrics_path.exists()):
        raise RunExistsError(f"{out} already holds a run (checkpoint.pt / metrics.jsonl); pass --resume to continue "
                             "it or choose another --output")
    if world is not None:
        world.barrier("start")  # rank 0 has checked the output folder
    run = build_run(cfg, world=world, log=log, extend_data=extend_data)
    if setup is not None:
        setup(run)
    model, private, data, device = run.model, run.private, run.data, run.device
    if main:
        out.mkdir(parents=True, exist_ok=True)
        resolved = {**cfg.to_dict(), "lr": run.lr, "target_modules": run.targets, "dataset_size": data.n_units,
                    "torch_device": str(device), "world_size": 1 if world is None else world.size,
                    "noise_multiplier": private.dp.noise_multiplier if private.dp else None,
                    "sample_rate": private.data_sampler.sample_rate, "data_notes": data.notes,
                    "lora_exclude_modules": run.exclude, "code_version": code_version()}
        write_json(out / "config.json", resolved)

    step = 0
    if ckpt is not None:
        private.load_state_dict(ckpt["private"])
        step = ckpt["step"]
        if main:
            kept = [ln for ln in metrics_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step] \
                if metrics_path.exists() else []
            write_text(metrics_path, "".join(ln + "\n" for ln in kept))
        log(f"[prismdp] resumed from step {step}")

    pad_id = run.tokenizer.pad_token_id
    model.train()
    bar = _progress(cfg.steps, step, progress)
    shown = report_steps(cfg.steps)  # epsilon costs an accountant call: shown at 8 steps, not every step
    eps_shown = "-"
    peak = PeakMemory(device).start()  # the training steps' peak (loading and evaluation excluded)
    loop_start = time.perf_counter()
    with (open(metrics_path, "a") if main else contextlib.nullcontext()) as metrics:
        for batch in private.batches():
            t0 = time.perf_counter()
            loss_sum, n = backward_batch(private, model, data.train, data.loss, batch, cfg.micro_batch_size, pad_id,
                                         device, cfg.group_by_length, units=data.units)
            stats = private.step()
            step += 1
            if world is not None and step % REPLICA_CHECK_EVERY == 0:
                private.check_replicas(step)
            record = {
                "step": step,
                "loss": loss_sum / n if n else None,
                "epsilon": private.epsilon if private.private and step in shown and main else None,
                "clip_fraction": stats.get("clip_fraction"),
                "clip_coef_mean": stats.get("clip_coef_mean"),
                "nonfinite": stats.get("nonfinite"),
                "batch_size": n,
                "lr": private.optimizer.param_groups[0]["lr"],
                "step_time_s": time.perf_counter() - t0,
                "elapsed_s": time.perf_counter() - loop_start,  # since this segment's loop began: all it did
            }
            if main:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if record["epsilon"] is not None:
                eps_shown = f"{record['epsilon']:.2f}@{step}"
            bar.set_postfix(loss=f"{record['loss']:.4f}" if n else "-", eps=eps_shown,
                            clip=f"{record['clip_fraction']:.2f}" if record["clip_fraction"] is not None else "-",
                            s=f"{record['step_time_s']:.2f}")
            bar.update(1)
            if step % cfg.checkpoint_every == 0 or step == cfg.steps or step == stop_after:
                private.check_replicas(step)
                state = _checkpoint(private, step, cfg)  # collective in a multi-process run
                if main:
                    _save_torch(ckpt_path, state)
            if stop_after is not None and step >= stop_after and step < cfg.steps:
                bar.close()
                return TrainResult({"interrupted_at": step}, model, run.tokenizer)
    bar.close()
    if not main:
        return TrainResult({"steps": step, "rank": world.rank}, model, run.tokenizer)
    return TrainResult(_finish(run, step, peak, progress), model, run.tokenizer)


def _finish(run, step: int, peak: PeakMemory, progress: bool) -> dict:
    """Privacy report, evaluation, adapter export and summary.json (rank 0)."""
    cfg, model, private, data = run.cfg, run.model, run.private, run.data
    out, pad_id = Path(cfg.output), run.tokenizer.pad_token_id
    model.eval()
    summary: dict = {"steps": step, "train": {**run_step_times(out / "metrics.jsonl"), **peak.read(),
                                              "device": str(run.device)}}
    privacy = private.privacy_report()
    privacy.update(dataset_size=data.n_units, privacy_unit=cfg.privacy_unit,
                   max_grad_norm=cfg.max_grad_norm if cfg.dp else None, method=cfg.method,
                   world_size=1 if run.world is None else run.world.size)
    write_json(out / "privacy.json", privacy)
    summary["privacy"] = privacy
    t_eval = time.perf_counter()
    evals = {name: evaluate_classification(model, feats, pad_id, cfg.eval_batch_size, data.task_name)
             for name, feats in data.eval_sets.items()}
    if data.gen_eval_sets:
        from ..eval.generation import run_eval_sets

        evals.update(run_eval_sets(model, run.tokenizer, data.gen_eval_sets, batch_size=cfg.eval_batch_size,
                                   max_new_tokens=cfg.max_new_tokens, aqua_rule=cfg.aqua_rule, progress=progress,
                                   generations_dir=out / "generations"))
    if evals:
        write_json(out / "eval.json", evals)
        summary["eval"] = evals
        summary["eval_time_s"] = time.perf_counter() - t_eval
    if data.gen_eval_missing:
        summary["eval_missing"] = data.gen_eval_missing
    head = {"pooling": cfg.pooling, "num_labels": run.num_labels} if cfg.pooling != "model" else None
    export_adapter(model, private.pairs, private.start, out / "adapter", head=head)
    write_json(out / "summary.json", summary)
    return summary
