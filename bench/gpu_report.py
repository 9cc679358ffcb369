"""The GPU benchmark's results (:mod:`bench.gpu`): per cell and variant the median step, tokens/s, model-FLOP
utilisation and step peak memory; paired per-round ratios; each variant's best micro-batch; issue 30's ratios and
targets; the Markdown report."""

from __future__ import annotations

import shlex
import statistics
from typing import List

from .gpu_models import FLOP_TERMS

GB = 1024 ** 3
RATIOS = [  # (name, numerator, denominator, issue 30's target)
    ("prism / reference", "prism", "reference", 1.10),
    ("dp-adamw / reference", "dp-adamw", "reference", 1.08),
    ("prism / dp-adamw", "prism", "dp-adamw", 1.03),
    ("prism-dropout / dp-adamw", "prism-dropout", "dp-adamw", 1.03),
    ("no-dp / reference", "no-dp", "reference", None),
    ("dp-adamw / opacus-dp-adamw", "dp-adamw", "opacus-dp-adamw", None),
    ("prism-householder / prism", "prism-householder", "prism", None),  # what CholeskyQR2 gains on CUDA
    ("prism-eager-loss / prism", "prism-eager-loss", "prism", None),  # what the compiled loss gains on CUDA
    ("prism-summed-grads / prism", "prism-summed-grads", "prism", None),  # what skipping the summed .grad gains
    ("prism-tf32-products / prism", "prism-tf32-products", "prism", None),  # what TF32 per-example products gain
    ("prism-bf16-products / prism", "prism-bf16-products", "prism", None),  # what bf16 per-example products gain
    ("prism-secure / prism", "prism-secure", "prism", 1.05),  # --secure-noise, drawn in the background (issue 44)
]
MEMORY_RATIOS = [("prism / reference", "prism", "reference", 1.10)]
TOKENS_TARGET = 25_000  # PRISM on the 1B shape on an H200 (issue 30)


def _median(xs):
    return statistics.median(xs) if xs else None


def summarize_shape(res: dict) -> None:
    """Per cell and variant: median, tokens/s, MFU, peak memory; paired per-round ratios per cell; each variant's
    best micro-batch (lowest median step); the ratios at the best micro-batches; memory ratios per micro-batch."""
    flops, tokens, peak = res["flops_per_token"]["total"], res["tokens_per_step"], res.get("peak_tflops")
    for cell in res["cells"]:
        for v in cell["variants"].values():
            if v.get("status") != "ok" or not v["times_s"]:
                continue
            med = statistics.median(v["times_s"])
            v.update(median_s=med, min_s=min(v["times_s"]), max_s=max(v["times_s"]), tokens_per_s=tokens / med,
                     mfu=flops * tokens / med / (peak * 1e12) if peak else None,
                     peak_gb=_median(v["peak_bytes"]) / GB if v["peak_bytes"] else None)
        timed = {n: v["times_s"] for n, v in cell["variants"].items() if v.get("median_s") is not None}
        cell["paired"] = {name: statistics.median(x / y for x, y in zip(timed[a], timed[b]))
                          for name, a, b, _ in RATIOS if a in timed and b in timed}
        cell["memory_ratios"] = {name: cell["variants"][a]["peak_gb"] / cell["variants"][b]["peak_gb"]
                                 for name, a, b, _ in MEMORY_RATIOS if a in timed and b in timed
                                 and cell["variants"][a]["peak_gb"] and cell["variants"][b]["peak_gb"]}
    best = {}
    for cell in res["cells"]:
        for n, v in cell["variants"].items():
            if v.get("median_s") is not None and (n not in best or v["median_s"] < best[n]["median_s"]):
                best[n] = {"micro": cell["micro"], **{k: v[k] for k in ("median_s", "tokens_per_s", "mfu",
                                                                        "peak_gb")}}
    res["best"] = best
    res["ratios"] = {}
    for name, a, b, target in RATIOS:
        if a in best and b in best:
            by_micro = {c["micro"]: c["paired"][name] for c in res["cells"] if name in c.get("paired", {})}
            res["ratios"][name] = {"ratio_of_best_medians": best[a]["median_s"] / best[b]["median_s"],
                                   "micro": [best[a]["micro"], best[b]["micro"]],
                                   "paired_median_by_micro": by_micro, "target": target}
    res["memory_ratios"] = {}
    for name, a, b, target in MEMORY_RATIOS:
        by_micro = {c["micro"]: c["memory_ratios"][name] for c in res["cells"] if name in c.get("memory_ratios", {})}
        if by_micro:
            res["memory_ratios"][name] = {"at_largest_common_micro": by_micro[max(by_micro)], "micro": max(by_micro),
                                          "by_micro": by_micro, "target": target}


def _fmt(x, spec=".3f", none="-"):
    return none if x is None else format(x, spec)


def _targets(report: dict) -> List[str]:
    rows = []
    for res in report["shapes"]:
        for name, r in res.get("ratios", {}).items():
            if r["target"] is not None:
                got = r["ratio_of_best_medians"]
                rows.append(f"| {name} step time (each at its best micro-batch {r['micro'][0]} / {r['micro'][1]}) | "
                            f"{res['shape']} | {got:.3f} | <= {r['target']:.2f} "
                            f"({'met' if got <= r['target'] else 'missed'}) |")
        for name, r in res.get("memory_ratios", {}).items():
            got = r["at_largest_common_micro"]
            ok = "met" if got <= r["target"] else "missed"
            rows.append(f"| {name} step peak memory above the resident state (micro-batch {r['micro']}) | "
                        f"{res['shape']} | {got:.3f} | <= {r['target']:.2f} ({ok}) |")
        prism = res.get("best", {}).get("prism")
        if prism and res["shape"] == "llama-3.2-1b":
            rows.append(f"| prism tokens/s (micro-batch {prism['micro']}) | {res['shape']} | "
                        f"{prism['tokens_per_s']:,.0f} | >= {TOKENS_TARGET:,} on an H200 |")
    if not rows:
        return []
    return ["## Targets (issue 30)", "", "| measure | shape | measured | target |", "|---|---|---:|---|", *rows, ""]


def _variant_row(name: str, micro: int, v: dict) -> str:
    if v.get("median_s") is None:
        return f"| {name} | {micro} | {v.get('status', 'no measured round')} | | | | | |"
    syncs = f"{v['host_syncs_per_step']}" + ("" if v.get("cuda_syncs_per_step") is None
                                             else f" ({v['cuda_syncs_per_step']})")
    mfu = None if v["mfu"] is None else 100 * v["mfu"]
    return (f"| {name} | {micro} | {v['median_s']:.3f} | {v['min_s']:.3f}-{v['max_s']:.3f} | "
            f"{v['tokens_per_s']:,.0f} | {_fmt(mfu, '.1f')} | {_fmt(v['peak_gb'], '.2f')} | {syncs} |")


def markdown(report: dict) -> str:
    env = report["environment"]
    v = env["versions"]
    lines = [f"# prismdp GPU benchmark: {env['device_name']}", ""]
    if report["tiny"]:
        lines += ["**Tiny shapes" + (" on the CPU" if env["device"] == "cpu" else "")
                  + ": a check of the benchmark script, not a measurement.**", ""]
    lines += [f"{env['date']}, commit {env['commit']}; torch {v['torch']} (CUDA {env['cuda'] or '-'}), transformers "
              f"{v['transformers']}, peft {v['peft']}, opacus {v['opacus']}; {env['device_name']}"
              + (f", bf16 peak {env['peak_tflops']:.0f} TFLOP/s dense" if env["peak_tflops"] else
                 ", bf16 peak unknown (no MFU)") + ".",
              f"Command: `{shlex.join(report['command'])}`; time budget {report['time_budget_s']:.0f} s, "
              f"{report['elapsed_s']:.0f} s used; status: {report['status']}.",
              "Per shape and micro-batch: one warm-up round (host syncs counted in it), then up to "
              f"{report['rounds']} measured rounds (at least {report['min_rounds']} where the budget allows), each a "
              "logical step of every variant in a rotated order, CUDA-synchronised; medians; ratios are ratios of "
              "medians at each variant's best micro-batch, with the medians of the per-round ratios at equal "
              "micro-batches beside them. Memory: the step's `torch.cuda.max_memory_allocated` above what was "
              "allocated before it (the variants share one copy of the frozen weights). Host syncs: tensor reads "
              "to the host per logical step plus factorisations that read their status on CUDA "
              "(`bench.micro.HostSyncCounter`; it also counts reads of tensors already "
              "on the host, e.g. AdamW's step counts), in brackets the synchronising CUDA calls "
              "(`torch.cuda.set_sync_debug_mode`: the device's own count).", ""]
    lines += [f"Note: {n}" for n in report.get("notes", [])] + ([""] if report.get("notes") else [])
    lines += _targets(report)
    for res in report["shapes"]:
        lines += [f"## {res['shape']}: {res.get('description', '')}", ""]
        if res.get("error"):
            lines += [f"Failed: `{res['error'][-500:]}`", ""]
        if "flops_per_token" not in res:
            lines += [f"Status: {res.get('status')}.", ""]
            continue
        f = res["flops_per_token"]
        lines += [f"Model FLOPs per token {f['total'] / 1e9:.6g} G = "
                  + " + ".join(f"{k} {f[k] / 1e9:.6g} G ({FLOP_TERMS[k]})" for k in FLOP_TERMS)
                  + f"; {res['tokens_per_step']:,} tokens per logical step. Frozen weights "
                  f"{res.get('frozen_weights_gb', 0):.2f} GB"
                  + (f", allocated after building every variant {res['resident_gb']:.2f} GB" if "resident_gb" in res
                     else "") + f"; attention `{res.get('attention')}`; built in {_fmt(res.get('build_s'), '.1f')} s.",
                  "", "| variant | micro-batch | median step (s) | min-max (s) | tokens/s | MFU % | step peak (GB) | "
                  "host syncs / step (CUDA) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for n, info in res.get("variants", {}).items():
            if info.get("status") not in (None, "ok"):
                lines.append(f"| {n} | - | {info['status']}: {info.get('error', '')[-200:]} | | | | | |")
        for cell in res["cells"]:
            if cell.get("skipped"):
                lines.append(f"| (all) | {cell['micro']} | skipped: {cell['skipped']} | | | | | |")
                continue
            lines += [_variant_row(n, cell["micro"], v) for n, v in cell["variants"].items()]
        if res.get("ratios"):
            lines += ["", "| ratio | best micro-batches | ratio of medians | paired, by micro-batch | target |",
                      "|---|---|---:|---|---:|"]
            for name, r in res["ratios"].items():
                paired = ", ".join(f"{m}: {x:.3f}" for m, x in r["paired_median_by_micro"].items()) or "-"
                lines.append(f"| {name} | {r['micro'][0]} / {r['micro'][1]} | {r['ratio_of_best_medians']:.3f} | "
                             f"{paired} | {_fmt(r['target'], '.2f')} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"
