"""The training run behind ``prismdp train``: load, make private, train on Poisson batches, evaluate, export.

Outputs in ``cfg.output``: ``config.json`` (resolved), ``metrics.jsonl`` (one record per step), ``checkpoint.pt``
(resumable), ``adapter/`` (stock PEFT, for the original base model), ``privacy.json``, ``eval.json`` (per eval set;
causal-LM tasks are evaluated by greedy generation on ``eval_tasks``, with the generations in ``generations/``)
and ``summary.json`` (privacy, eval and any ``eval_missing`` sets; ``prismdp experiment`` reads its Table-2 columns
from eval: :mod:`prismdp.experiment.columns`).
Every file is written atomically (``metrics.jsonl`` is appended to, one line per step; a line cut short by a kill is
dropped on resume).  The per-step loss and clip fraction in ``metrics.jsonl`` are computed on the private training
data and are *not* covered by the DP guarantee: keep them with the data.

Resuming (``resume=True``) checks everything before it writes anything: the configuration (with the learning rate and
LoRA targets as resolved), the training data (a SHA-256 of the tokenised examples, stored in the checkpoint and
``config.json``) and the checkpoint's mechanism state; a refused resume changes no file.  A run that fails before its
first checkpoint removes the files it created.  Ctrl-C / SIGTERM stop after the current step with a checkpoint
(:mod:`prismdp.train.interrupt`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import code_version
from ..atomic import dumps_json, write_json
from ..distributed import init_from_env
from ..export import export_adapter
from ..privacy import report_steps
from ..processes import REPLICA_CHECK_EVERY  # noqa: F401  (its old import path; the cadence is the engine's)
from .build import build_run, default_lr
from .config import ConfigError, TrainConfig
from .interrupt import StopRequest, TrainingInterrupted
from .profile import PeakMemory, run_step_times
from .run_folder import RunExistsError, RunFolder, read_metrics
from .step import backward_batch
from .tasks import evaluate_classification

__all__ = ["train", "TrainResult", "RunExistsError", "TrainingInterrupted"]

# Keys that may differ between an interrupted run and its resumption.
_RESUMABLE_DIFFS = {"output", "threads"}  # where the files go, how many CPU threads compute


@dataclass
class TrainResult:
    summary: dict  # what summary.json holds; {"interrupted_at": step} for a stopped run
    model: torch.nn.Module  # the trained PEFT model (on the compensated base weights)
    tokenizer: object


def _checkpoint(run, step: int, fingerprint: str) -> dict:
    """What a resume needs (``run.private.state_dict()`` is collective in a multi-process run), with the resolved
    learning rate and LoRA targets and the training data's fingerprint, which a resume must match."""
    return {"step": step, "config": run.cfg.to_dict(), "lr": run.lr, "target_modules": run.targets,
            "data": {"fingerprint": fingerprint, "units": run.data.n_units}, "private": run.private.state_dict()}


def _saved_config(ckpt: dict) -> TrainConfig | None:
    """The checkpoint's configuration as a TrainConfig of this version (defaults for keys added since), if valid."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        return TrainConfig.from_dict({k: v for k, v in ckpt["config"].items() if k in known})
    except (ValueError, TypeError):
        return None


def _check_resume(cfg: TrainConfig, ckpt: dict, lr: float) -> None:
    """The configuration must be the checkpoint's (the learning rate compared as resolved: ``--lr 2e-4`` resumes a run
    that used the default 2e-4)."""
    saved_cfg = _saved_config(ckpt)
    saved = saved_cfg.to_dict() if saved_cfg is not None else ckpt["config"]
    diffs = {k: (saved.get(k), v) for k, v in cfg.to_dict().items()
             if saved.get(k) != v and k not in _RESUMABLE_DIFFS | {"lr", "target_modules"}}
    saved_lr = ckpt.get("lr", saved.get("lr"))
    if saved_lr is None and saved_cfg is not None:
        saved_lr = default_lr(saved_cfg)
    if saved_lr != lr:
        diffs["lr"] = (saved_lr, lr)
    if cfg.target_modules is not None and saved.get("target_modules") is not None \
            and list(saved["target_modules"]) != list(cfg.target_modules):
        diffs["target_modules"] = (saved["target_modules"], cfg.target_modules)
    if diffs:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diffs.items())
        raise ConfigError(f"--resume with a different configuration ({detail}); resume with the original settings")


def _check_resumed_run(ckpt: dict, run, fingerprint: str, log) -> None:
    """The data and the resolved LoRA targets must be the checkpoint's."""
    saved_targets = ckpt.get("target_modules", ckpt["config"].get("target_modules"))
    if saved_targets is not None and list(saved_targets) != list(run.targets):
        raise ConfigError(f"--resume with different LoRA targets (checkpoint {saved_targets} vs now {run.targets}); "
                          "resume with the original settings")
    data = ckpt.get("data")
    if data is None:
        log("[prismdp] warning: the checkpoint predates data fingerprints; the training data cannot be checked")
        return
    if data["fingerprint"] != fingerprint:
        unit = "user" if run.cfg.privacy_unit == "user" else "example"
        then, now = data["units"], run.data.n_units
        what = f"{then} training {unit}s then, {now} now" if then != now else \
            f"as many {unit}s ({now}) but different content"
        raise ConfigError(
            f"--resume: the training data changed since the checkpoint ({what}; SHA-256 of the tokenised data "
            f"{data['fingerprint'][:12]}... then, {fingerprint[:12]}... now). The steps taken were accounted for the "
            "old data: resume with the run's data and tokenizer, or start a new run with another --output")


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="train", unit="step", dynamic_ncols=True)


def train(cfg: TrainConfig, *, resume: bool = False, stop_after: int | None = None, progress: bool = True,
          log=print, setup=None, extend_data=None) -> TrainResult:
    """Run (or resume) one training job; returns the final summary (privacy report and evaluation).

    ``setup(run)`` is called with the built :class:`~prismdp.train.build.Run` before the first step (observers attach
    their hooks there, e.g. the audit's canaries); ``extend_data`` goes to :func:`~prismdp.train.build.build_run`.

    ``resume``: continue from the checkpoint in ``cfg.output``, or start from step 0 if there is none (a run that
    stopped before its first checkpoint is restarted).  Ctrl-C / SIGTERM: the step under way is finished, a
    checkpoint saved and :class:`TrainingInterrupted` raised.

    Under ``torchrun`` (or in an initialised process group) every process runs this with the same configuration: they
    train one private run together (:mod:`prismdp.distributed`); rank 0 alone writes files, shows progress and
    evaluates."""
    with _torch_threads(cfg.threads):
        return _train(cfg, resume, stop_after, progress, log, setup, extend_data)


@contextlib.contextmanager
def _torch_threads(n: int | None):
    """torch's CPU threads set to ``n`` inside, the caller's count again after (a library call, e.g. an experiment's
    next cell); ``None`` leaves them alone."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train(cfg: TrainConfig, resume: bool, stop_after: int | None, progress: bool, log, setup, extend_data
           ) -> TrainResult:
    world = init_from_env()
    main = world is None or world.main
    if not main:
        progress, log = False, (lambda *a, **k: None)
    folder = RunFolder(cfg.output)
    lr = cfg.lr if cfg.lr is not None else default_lr(cfg)  # (validates the method)
    has_ckpt = folder.check_start(resume) if main else resume and folder.checkpoint_path.is_file()
    ckpt = None
    if has_ckpt:
        ckpt = folder.load_checkpoint()
        _check_resume(cfg, ckpt, lr)
    elif resume:
        log(f"[prismdp] --resume: no checkpoint in {folder.path}; starting the run from step 0")
    if world is not None:
        world.barrier("start")  # rank 0 has checked the output folder
    run = build_run(cfg, world=world, log=log, extend_data=extend_data)
    if setup is not None:
        setup(run)
    private, data, device = run.private, run.data, run.device
    fingerprint = data.fingerprint()
    step = 0
    if ckpt is not None:  # every check before any file is written: a refused resume changes nothing
        _check_resumed_run(ckpt, run, fingerprint, log)
        private.load_state_dict(ckpt["private"])
        step = ckpt["step"]
    kept = [r for r in read_metrics(folder.metrics_path) if r["step"] <= step] if ckpt is not None else []
    if main:
        folder.prepare(kept)
        resolved = {**cfg.to_dict(), "lr": run.lr, "target_modules": run.targets, "dataset_size": data.n_units,
                    "data_fingerprint": fingerprint, "torch_device": str(device),
                    "world_size": 1 if world is None else world.size,
                    "noise_multiplier": private.dp.noise_multiplier if private.dp else None,
                    "sample_rate": private.data_sampler.sample_rate, "data_notes": data.notes,
                    "lora_exclude_modules": run.exclude, "code_version": code_version()}
        write_json(folder.config_path, resolved)
    if ckpt is not None:
        log(f"[prismdp] resumed from step {step}")
    try:
        return _train_steps(run, folder, step, fingerprint, stop_after, progress, log)
    except BaseException:
        if main:
            folder.undo()  # failed before any checkpoint: remove what this run created
        raise


def _train_steps(run, folder: RunFolder, step: int, fingerprint: str, stop_after: int | None, progress: bool,
                 log) -> TrainResult:
    cfg, model, private, data, device, world = run.cfg, run.model, run.private, run.data, run.device, run.world
    main = world is None or world.main
    pad_id = run.tokenizer.pad_token_id
    model.train()
    bar = _progress(cfg.steps, step, progress)
    shown = report_steps(cfg.steps)  # epsilon costs an accountant call: shown at 8 steps, not every step
    eps_shown = "-"
    peak = PeakMemory(device).start()  # the training steps' peak (loading and evaluation excluded)
    loop_start = time.perf_counter()
    with StopRequest(log, escalate=world is None) as stop, \
            (open(folder.metrics_path, "a") if main else contextlib.nullcontext()) as metrics:
        for batch in private.batches():
            t0 = time.perf_counter()
            totals = backward_batch(private, model, data.train, data.loss, batch, cfg.micro_batch_size, pad_id,
                                    device, cfg.group_by_length, units=data.units)
            report = private.queue_step(totals)
            if world is not None:  # a stop request on any rank stops every rank after this step (agreed in the read)
                agreed = world.queue_max(int(stop.requested), "stop request")
                report = dataclasses.replace(report, flags={"stop": agreed})
            stats = report.read()  # the step's one host read, after its update is queued
            n = stats["examples"]
            step_time = time.perf_counter() - t0  # the step (its host reads included), not the accountant or the log
            step += 1
            stopping = stats["stop"] > 0 if world is not None else stop.requested
            record = {
                "step": step,
                "loss": stats["loss"],
                "epsilon": private.epsilon if private.private and step in shown and main else None,
                "clip_fraction": stats.get("clip_fraction"),
                "clip_coef_mean": stats.get("clip_coef_mean"),
                "nonfinite": stats.get("nonfinite"),
                "batch_size": n,
                "lr": private.optimizer.param_groups[0]["lr"],
                "step_time_s": step_time,
                "elapsed_s": time.perf_counter() - loop_start,  # since this segment's loop began: all it did
            }
            if main:
                metrics.write(dumps_json(record) + "\n")
                metrics.flush()
            if record["epsilon"] is not None:
                eps_shown = f"{record['epsilon']:.2f}@{step}"
            bar.set_postfix(loss=f"{record['loss']:.4f}" if n else "-", eps=eps_shown,
                            clip=f"{record['clip_fraction']:.2f}" if record["clip_fraction"] is not None else "-",
                            s=f"{record['step_time_s']:.2f}")
            bar.update(1)
            stopping = stopping and step < cfg.steps
            save = step % cfg.checkpoint_every == 0 or step == cfg.steps or step == stop_after or stopping
            private.after_step(step, checkpoint=save)  # replicas compared (a no-op in one process)
            if save:
                state = _checkpoint(run, step, fingerprint)  # collective in a multi-process run
                if main:
                    folder.save_checkpoint(state)
            if stopping:
                bar.close()
                raise TrainingInterrupted(step, cfg.steps, cfg.output, stop.signame or "a stop request to another process",
                                          main)
            if stop_after is not None and step >= stop_after and step < cfg.steps:
                bar.close()
                return TrainResult({"interrupted_at": step}, model, run.tokenizer)
    bar.close()
    if not main and not private.lockstep:
        return TrainResult({"steps": step, "rank": world.rank}, model, run.tokenizer)
    summary = _finish(run, step, peak, progress, main)  # a sharded base: every rank evaluates, rank 0 writes
    return TrainResult(summary if main else {"steps": step, "rank": world.rank}, model, run.tokenizer)


def _evaluate(run, pad_id: int, progress: bool, generations_dir: Path | None) -> dict:
    cfg, model, data = run.cfg, run.model, run.data
    evals = {name: evaluate_classification(model, feats, pad_id, cfg.eval_batch_size, data.task_name)
             for name, feats in data.eval_sets.items()}
    if data.gen_eval_sets:
        from ..eval.generation import run_eval_sets

        evals.update(run_eval_sets(model, run.tokenizer, data.gen_eval_sets, batch_size=cfg.eval_batch_size,
                                   max_new_tokens=cfg.max_new_tokens, aqua_rule=cfg.aqua_rule, progress=progress,
                                   generations_dir=generations_dir))
    return evals


def _finish(run, step: int, peak: PeakMemory, progress: bool, main: bool = True) -> dict:
    """Privacy report, evaluation, adapter export and summary.json (rank 0; with a sharded base the other ranks run
    the same evaluation beside it, since each forward gathers weights from every rank, and write nothing)."""
    cfg, model, private, data = run.cfg, run.model, run.private, run.data
    out, pad_id = Path(cfg.output), run.tokenizer.pad_token_id
    model.eval()
    if not main:
        _evaluate(run, pad_id, progress, generations_dir=None)
        return {}
    summary: dict = {"steps": step, "train": {**run_step_times(out / "metrics.jsonl"), **peak.read(),
                                              "device": str(run.device)}}
    privacy = private.privacy_report()
    privacy.update(dataset_size=data.n_units, privacy_unit=cfg.privacy_unit,
                   max_grad_norm=cfg.max_grad_norm if cfg.dp else None, method=cfg.method,
                   world_size=1 if run.world is None else run.world.size)
    write_json(out / "privacy.json", privacy)
    summary["privacy"] = privacy
    t_eval = time.perf_counter()
    evals = _evaluate(run, pad_id, progress, generations_dir=out / "generations")
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
