"""What the per-example causal-LM loss costs (issue 30): forward + loss + backward of a causal LM under LoRA, with

* ``own``: the model's own loss (``model(..., labels=labels).loss``, transformers' token-mean cross-entropy over the
  flattened logits): what a user of plain PEFT would run, the reference;
* ``old``: prismdp's per-example loss before issue 30, kept here as the baseline: ``F.cross_entropy`` over the
  transposed ``(b, V, T)`` float32 copy of the logits (softmax over a non-last dimension);
* ``new``: :func:`prismdp.losses.causal_lm_losses` (last-dimension cross-entropy, chunked upcast, no float32 copy).

Section ``step``: the whole forward + loss + backward of the workload's PEFT model on one micro-batch (random tokens,
every token a target).  Section ``loss``: the loss alone, forward + backward on fixed logits of the same shape.
Variants interleaved round by round (order rotated), medians of the per-round times and of the paired per-round
ratios to ``own``.  Writes ``OUT/loss.json`` and ``OUT/loss.md``.

    python -m bench.loss                                   # W2: SmolLM2-135M, micro-batch 4 x 128, vocabulary 49,152
    python -m bench.loss --threads 1 --clock cpu --rounds 10 --output bench/results/loss
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from .workloads import CLOCKS, WORKLOADS, _peft

VARIANTS = ("own", "old", "new")
TARGET = 1.10  # issue 30: the per-example loss at most 1.10x the model's own loss (section "step")


def old_causal_lm_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """prismdp's per-example loss before issue 30 (the baseline): float32 copy, softmax over dimension 1."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    tok = F.cross_entropy(shift_logits.transpose(1, 2), shift_labels, ignore_index=-100, reduction="none")
    return tok.sum(dim=1) / (shift_labels != -100).sum(dim=1).clamp_min(1)


def _own_loss_on_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss as the model computes it from its logits (``ForCausalLMLoss``)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])


def _step_fns(model, ids, labels) -> Dict[str, Callable[[], None]]:
    from prismdp.losses import causal_lm_losses

    def own():
        model(input_ids=ids, labels=labels).loss.backward()

    def per_example(fn):
        def run():
            fn(model(input_ids=ids).logits, labels).sum().backward()
        return run

    return {"own": own, "old": per_example(old_causal_lm_losses), "new": per_example(causal_lm_losses)}


def _loss_fns(logits, labels) -> Dict[str, Callable[[], None]]:
    from prismdp.losses import causal_lm_losses

    def run(fn):
        def go():
            fn(logits, labels).sum().backward()
            logits.grad = None
        return go

    return {"own": run(_own_loss_on_logits), "old": run(old_causal_lm_losses), "new": run(causal_lm_losses)}


def interleave(fns: Dict[str, Callable[[], None]], rounds: int, warmup: int, clock) -> Dict[str, List[float]]:
    """Each round runs every variant once, the order rotated by one per round; the warm-up rounds are dropped."""
    names = list(fns)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t = clock()
            fns[n]()
            dt = clock() - t
            if r >= warmup:
                times[n].append(dt)
    return times


def summarize(times: Dict[str, List[float]]) -> dict:
    ref = times["own"]
    return {n: {"median_s": statistics.median(ts), "times_s": ts,
                "over_own_paired_median": statistics.median(a / b for a, b in zip(ts, ref))}
            for n, ts in times.items()}


def run(workload: str = "W2", rounds: int = 10, warmup: int = 2, clock: str = "wall", sections=("step", "loss"),
        log=print) -> dict:
    w = WORKLOADS[workload]
    if w.task_type != "causal_lm":
        raise ValueError(f"bench.loss needs a causal-LM workload; {workload} is {w.task_type}")
    model = _peft(w.load(), w)
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (w.micro, w.seq_len), generator=g)
    report = {"workload": workload, "description": w.description, "micro_batch": [w.micro, w.seq_len],
              "vocab": vocab, "rounds": rounds, "warmup": warmup, "clock": clock, "sections": {}}
    if "step" in sections:
        report["sections"]["step"] = summarize(interleave(_step_fns(model, ids, ids), rounds, warmup, CLOCKS[clock]))
        log("[bench.loss] step: " + _line(report["sections"]["step"]))
    if "loss" in sections:
        logits = torch.randn(w.micro, w.seq_len, vocab, generator=g).requires_grad_()
        report["sections"]["loss"] = summarize(interleave(_loss_fns(logits, ids), rounds, warmup, CLOCKS[clock]))
        log("[bench.loss] loss: " + _line(report["sections"]["loss"]))
    return report


def _line(sec: dict) -> str:
    return ", ".join(f"{n} {v['median_s']:.3f}s ({v['over_own_paired_median']:.2f}x)" for n, v in sec.items())


SECTION_TITLES = {"step": "forward + loss + backward of the PEFT model, one micro-batch",
                  "loss": "the loss alone on fixed logits, forward + backward"}


def markdown(report: dict) -> str:
    env = report.get("environment", {})
    lines = ["# Per-example causal-LM loss (issue 30)", "",
             f"{env.get('date', '')}, commit {env.get('commit', '?')}, torch {torch.__version__}, "
             f"{env.get('threads', '?')} thread(s); {report['workload']}: {report['description']}; micro-batch "
             f"{report['micro_batch'][0]} x {report['micro_batch'][1]}, vocabulary {report['vocab']:,}. "
             f"{report['warmup']} warm-up + {report['rounds']} rounds, variants interleaved (order rotated per "
             f"round); {'process CPU time' if report['clock'] == 'cpu' else 'wall time'}; ratios are medians of the "
             "per-round ratios to `own`.", "",
             "`own`: the model's own loss (`labels=`); `old`: prismdp's per-example loss before issue 30 "
             "(`F.cross_entropy` on the transposed float32 copy); `new`: `prismdp.losses.causal_lm_losses`.", ""]
    for name, sec in report["sections"].items():
        lines += [f"## {SECTION_TITLES[name]}", "", "| variant | median (s) | / own (paired median) |",
                  "|---|---:|---:|"]
        lines += [f"| {n} | {v['median_s']:.3f} | {v['over_own_paired_median']:.3f} |" for n, v in sec.items()]
        if name == "step":
            got = sec["new"]["over_own_paired_median"]
            lines += ["", f"Target (issue 30): new / own <= {TARGET:.2f}: {got:.3f}, "
                          f"{'met' if got <= TARGET else 'missed'}."]
        lines.append("")
    notes = report.get("notes")
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None) -> int:
    from .common import environment, write

    p = argparse.ArgumentParser(prog="python -m bench.loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="W2", help="a causal-LM workload of bench.workloads (default W2)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    p.add_argument("--sections", default="step,loss", help="of step, loss (default both)")
    p.add_argument("--note", action="append", default=[])
    p.add_argument("--output", default=str(Path(__file__).resolve().parent / "results" / "loss"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTION_TITLES]
    if bad or args.workload not in WORKLOADS:
        p.error(f"unknown section {bad} or workload {args.workload!r}; sections {list(SECTION_TITLES)}, "
                f"workloads {list(WORKLOADS)}")
    report = run(args.workload, args.rounds, args.warmup, args.clock, sections)
    report["environment"], report["notes"] = environment(args.threads), args.note
    out = Path(args.output)
    write(out / "loss.json", json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    write(out / "loss.md", md)
    print(md)
    print(f"[bench.loss] wrote {out / 'loss.json'} and {out / 'loss.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
