"""Tasks the trainer knows: what model head they need, their tokenised data, their loss and evaluation."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from ..data import build_instruct_dataset, encode_classification, load_glue, load_instruct_json, make_synthetic_task
from ..data.collate import pad_collate
from ..data.splits import carve, seeded_subset
from ..data.tasks import TASKS, glue_task
from ..eval.metrics import glue_metrics, main_score
from ..losses import causal_lm_losses, classification_losses
from .step import model_inputs
from .config import ConfigError, TrainConfig

__all__ = ["TaskData", "task_head", "build_task_data", "check_targets_left", "MASKED_WARN_SHARE", "evaluate_classification", "DEFAULT_TARGETS", "default_targets",
           "lora_exclude_modules", "model_inputs"]

# LoRA targets per model family when --target-modules is not given (the paper's q, k, v, up, down for decoders)
DEFAULT_TARGETS = {
    "bert": ["query", "value"],  # the original LoRA paper's choice for encoders
    "roberta": ["query", "value"],
    "distilbert": ["q_lin", "k_lin", "v_lin"],
    "llama": ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"],
    "gemma": ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"],
    "gemma2": ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"],
    "gemma3": ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"],
    "gemma3_text": ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"],
}


def default_targets(model: nn.Module) -> list[str]:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in DEFAULT_TARGETS:
        raise ConfigError(
            f"target_modules: no default LoRA targets for model type {model_type!r}; pass --target-modules with the "
            "names of its attention/MLP projection layers (e.g. q_proj,v_proj)"
        )
    return list(DEFAULT_TARGETS[model_type])


# Sub-models of multimodal checkpoints (e.g. google/gemma-3-4b-pt loads as Gemma3ForConditionalGeneration) that
# text-only training never runs: LoRA there would get no activations (and no per-example gradients).
_NON_TEXT_MODULES = ("vision_tower", "vision_model", "multi_modal_projector", "audio_tower")


def lora_exclude_modules(model: nn.Module) -> str | None:
    """PEFT ``exclude_modules`` regex keeping LoRA on the language model of a multimodal model, else None."""
    present = sorted({part for name, _ in model.named_modules() for part in name.split(".")
                      if part in _NON_TEXT_MODULES})
    if not present:
        return None
    return r".*\b(?:" + "|".join(present) + r")\b.*"


@dataclass
class TaskData:
    task_type: str  # "seq_cls" | "causal_lm"
    train: list[dict]
    loss: Callable[[Tensor, Tensor], Tensor]  # (logits, labels) -> (b,) per-example losses
    eval_sets: dict[str, list[dict]] = field(default_factory=dict)
    task_name: str | None = None  # GLUE metric name
    notes: dict = field(default_factory=dict)  # counts of truncated / fully masked examples
    gen_eval_sets: list = field(default_factory=list)  # prismdp.eval.sets.EvalSet (causal-LM tasks)
    gen_eval_missing: dict = field(default_factory=dict)  # requested eval sets whose files were not found
    units: list[list[int]] | None = None  # user-level privacy: per user, the indices of its training examples
    warnings: list[str] = field(default_factory=list)  # problems of the data the run trains anyway (shown before it)

    @property
    def n_units(self) -> int:
        """What the privacy guarantee counts: users, or examples."""
        return len(self.units) if self.units is not None else len(self.train)

    def fingerprint(self) -> str:
        """SHA-256 of the tokenised training set as the mechanism sees it (every example's token ids, token types and
        labels, in order, and the privacy units): a resumed run refuses data that changed since its checkpoint."""
        import numpy as np

        h = hashlib.sha256()
        for ex in self.train:
            for key in ("input_ids", "token_type_ids", "labels"):
                value = ex.get(key)
                a = np.asarray(value.tolist() if isinstance(value, Tensor) else value if value is not None else [])
                h.update(f"{key}:{a.dtype.kind}:{a.shape};".encode())
                h.update(np.ascontiguousarray(a, dtype=np.float64 if a.dtype.kind == "f" else np.int64).tobytes())
        h.update(repr(self.units).encode())
        return h.hexdigest()


def task_head(cfg: TrainConfig) -> tuple[str, int | None]:
    """(task_type, num_labels) the model must be loaded with (:data:`prismdp.data.tasks.TASKS`)."""
    task = TASKS[cfg.task]
    return task.head, task.num_labels


def _generation_evals(cfg: TrainConfig) -> tuple[list, dict]:
    """Test sets of a causal-LM task (``eval_tasks``; glue8 defaults to its eight GLUE tasks)."""
    from ..eval.sets import resolve_eval_sets

    names = cfg.eval_tasks if cfg.eval_tasks is not None else (["glue8"] if cfg.task == "glue8" else [])
    if not names:
        return [], {}
    eval_data = cfg.eval_data
    if eval_data is None and cfg.data is not None:
        eval_data = cfg.data if cfg.task == "glue8" else str(Path(cfg.data).expanduser().parent)
    return resolve_eval_sets(names, eval_data, limit=cfg.eval_examples)


# More than this share of training examples without a target token is warned (docs/data.md): they are sampled and
# cost privacy budget like the others but train nothing, so a tenth of the budget spent on them is worth a look
MASKED_WARN_SHARE = 0.10


def check_targets_left(n_masked: int, n: int, cfg: TrainConfig) -> list[str]:
    """Examples whose every label is masked (their prompt alone fills ``--max-length`` and the prompt is not trained
    on) train nothing: all of them is a :class:`ConfigError`, raised before any budget is spent; more than
    :data:`MASKED_WARN_SHARE` of them a warning returned (as a list of at most one message); both name the fix."""
    fix = (f"Fix: raise --max-length (now {cfg.max_length}) so that the answers fit after their prompts, or pass "
           "--train-on-inputs to train on the prompts too")
    if n and n_masked == n:
        raise ConfigError(f"max_length: none of the {n} training examples has a target token left: each prompt "
                          f"alone fills {cfg.max_length} tokens and the prompts are not trained on, so the run would "
                          f"spend its privacy budget on a loss of 0. {fix}")
    if n_masked > MASKED_WARN_SHARE * n:
        return [f"{n_masked} of {n} training examples ({100 * n_masked / n:.0f} %) have no target token left after "
                f"truncation to {cfg.max_length} tokens: they are sampled and cost privacy budget but train nothing. "
                f"{fix}"]
    return []


def build_task_data(cfg: TrainConfig, tokenizer) -> TaskData:
    if TASKS[cfg.task].head == "causal_lm":
        if cfg.task == "glue8":
            from ..data.glue8 import build_glue8, glue8_records

            items = build_glue8(cfg.data, cfg.glue8_per_task, cfg.seed)
            records = seeded_subset(glue8_records(items), cfg.train_examples, cfg.seed)
            extra = {f"glue8_{t}": sum(it.task == t for it in items) for t in dict.fromkeys(it.task for it in items)}
        else:
            if cfg.data is None:
                raise ConfigError("data: --task instruct needs --data PATH to an LLM-Adapters JSON file "
                                  "(records with instruction, input, output), e.g. math_10k.json")
            keep = (cfg.user_id_column,) if cfg.user_id_column else ()
            records = seeded_subset(load_instruct_json(cfg.data, keep=keep), cfg.train_examples, cfg.seed)
            extra = {}
        gen_sets, gen_missing = _generation_evals(cfg)  # before tokenising: a bad eval setup fails fast
        ds = build_instruct_dataset(records, tokenizer, cfg.max_length, cfg.train_on_inputs, fully_masked="keep")
        warned = check_targets_left(ds.n_fully_masked, len(ds.examples), cfg)
        feats = [{k: ex[k] for k in ("input_ids", "attention_mask", "labels")} for ex in ds.examples]
        notes = {"train_examples": len(feats), "truncated": ds.n_truncated, "fully_masked": ds.n_fully_masked,
                 **extra, **{f"{s.name}_examples": len(s.golds) for s in gen_sets}}
        units = None
        if cfg.user_id_column:
            if cfg.task != "instruct":
                raise ConfigError(f"privacy_unit: user-level privacy needs a user id in every record; task "
                                  f"{cfg.task!r} has none (use task instruct with records that name their user)")
            by_user: dict = {}
            for i, rec in enumerate(records):
                by_user.setdefault(rec[cfg.user_id_column], []).append(i)
            units = list(by_user.values())
            notes["users"] = len(units)
        return TaskData("causal_lm", feats, causal_lm_losses, notes=notes, gen_eval_sets=gen_sets,
                        gen_eval_missing=gen_missing, units=units, warnings=warned)
    if cfg.user_id_column:
        raise ConfigError(f"privacy_unit: user-level privacy needs a user id in every record; task {cfg.task!r} has "
                          "none (use task instruct with records that name their user)")
    if cfg.task == "synthetic":
        train_ex, test_ex = make_synthetic_task(cfg.synthetic_train, cfg.synthetic_test, seed=0)
        evals = {"test": test_ex}
        num_labels, task_name = 2, None
    else:
        task = TASKS[cfg.task].glue
        num_labels, task_name = task.num_labels, task.name
        pool = load_glue(task.name, "train", cfg.data)
        held = [(k, n) for k, n in (("test", cfg.holdout_test), ("val", cfg.holdout_val)) if n]
        pool, evals = carve(pool, held) if held else (pool, {})
        train_ex = seeded_subset(pool, cfg.train_examples, cfg.seed)
        if not cfg.holdout_test:  # the official dev set(s)
            splits = task.eval_splits
            unknown = [s for s in cfg.eval_splits or () if s not in splits]
            if unknown:
                raise ConfigError(f"eval_splits: {unknown} are not {task.name} validation splits ({', '.join(splits)})")
            evals.update({s: load_glue(task.name, s, cfg.data) for s in cfg.eval_splits or splits})
    enc = encode_classification(train_ex, tokenizer, cfg.max_length, num_labels)
    notes = {"train_examples": len(enc.features), "truncated": enc.n_truncated, "blank": enc.n_blank}
    eval_sets = {}
    for name, exs in evals.items():
        exs = exs[: cfg.eval_examples] if cfg.eval_examples else exs
        e = encode_classification(exs, tokenizer, cfg.max_length, num_labels)
        eval_sets[name] = e.features
        notes[f"{name}_examples"], notes[f"{name}_truncated"] = len(e.features), e.n_truncated
        notes[f"{name}_blank"] = e.n_blank
    return TaskData("seq_cls", enc.features, classification_losses, eval_sets, task_name, notes)


@torch.no_grad()
def evaluate_classification(model: nn.Module, features: list[dict], pad_id: int, batch_size: int,
                            task_name: str | None, progress=None) -> dict:
    """Batched evaluation: accuracy (and the GLUE metrics of ``task_name``) of the argmax prediction."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    order = sorted(range(len(features)), key=lambda i: len(features[i]["input_ids"]))  # less padding
    preds: list = [None] * len(features)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        batch = pad_collate([features[i] for i in chunk], pad_id)
        logits = model(**model_inputs(batch, device)).logits.cpu()
        for i, p in zip(chunk, logits.squeeze(-1) if logits.shape[-1] == 1 else logits.argmax(-1)):
            preds[i] = p
        if progress is not None:
            progress.update(len(chunk))
    model.train(was_training)
    y_pred = torch.stack(preds)
    y_true = torch.stack([torch.as_tensor(f["labels"]) for f in features])
    if y_pred.is_floating_point():
        out = {}
    else:
        out = {"accuracy": float((y_pred == y_true).float().mean())}
        out["majority_baseline"] = float(torch.bincount(y_true).max()) / len(y_true)
    if task_name is not None:
        glue = glue_task(task_name)
        metric_task = glue.eval_set_name(glue.eval_splits[0])  # MNLI: mnli_matched (its metrics: accuracy)
        metrics = glue_metrics(metric_task, y_true.tolist(), y_pred.tolist())
        out.update(metrics)
        out["score"] = main_score(metric_task, metrics)
    out["n"] = len(features)
    return out
