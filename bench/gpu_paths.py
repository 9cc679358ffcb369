"""The code paths that have not run on a GPU, each as one short ``prismdp train`` job on CUDA:
``python -m bench.gpu_paths`` (from the repository root; about 4 minutes on one H100 with the packaged SmolLM2).

Every check trains the same causal-LM job (a generated arithmetic instruction file and a GSM8K-style test set of 4
examples beside it, 6 steps, batch 16, micro-batch 8, epsilon 8, seed 0) with its own flags, in its own process:

==================  ====================================================================================
bf16                ``--dtype bfloat16`` (the reference of the comparisons below)
bf16-checkpointing  ``+ --gradient-checkpointing``: its losses against bf16's
resume              bf16 stopped half-way (``--stop-after``), then ``--resume``: privacy.json and losses
                    against bf16's
float16             ``--dtype float16``
secure-noise        ``+ --secure-noise`` (ChaCha20 noise and sampling, copied to the device)
4bit                ``+ --quantize 4bit`` (bitsandbytes' CUDA kernels)
fsdp-bf16           ``torchrun --nproc-per-node N ... --fsdp`` (FSDP2 on NCCL; its Poisson batches are drawn
                    per rank, so its losses are not bf16's)
fsdp-4bit           ``+ --quantize 4bit`` under ``--fsdp`` (torchao's NF4 on CUDA)
==================  ====================================================================================

A check passes when its job exits 0, writes privacy.json with the bf16 job's accounting (steps, sample rate, noise
multiplier, epsilon), has supervised tokens and no non-finite loss or gradient, and, where it has a reference, its
losses are within ``--loss-tol`` of it (bf16 arithmetic and CUDA's non-deterministic reductions differ in the last
bits; a wrong path differs by much more).  Results:
``OUT/gpu-paths-<device>.json`` and ``.md`` (written after every check); the exit code is the number of failures.
The fsdp checks need two processes, one GPU each (``--nproc``, default the number of GPUs): on a one-GPU host
they are reported as skipped.

``--model random``: a random-init Llama of SmolLM2-135M's shape saved in bf16, with a byte-level BPE tokenizer
trained on the generated data (nothing to install or download: for a GPU host without the packaged model).
Without CUDA, ``--device cpu`` runs the same checks on the CPU (gloo for fsdp-*), as the tests do with a tiny model.

    python -m bench.gpu_paths                                 # every check, packaged SmolLM2, cuda
    python -m bench.gpu_paths --model random                  # the same shape, random weights, no package needed
    python -m bench.gpu_paths --only bf16,resume --model PATH # a subset, another model
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import code_commit

BF16 = ["--dtype", "bfloat16"]
CHECKS = {  # name -> (flags, launched by torchrun, the check whose losses it must reproduce)
    "bf16": (BF16, False, None),
    "bf16-checkpointing": (BF16 + ["--gradient-checkpointing"], False, "bf16"),
    "resume": (BF16, False, "bf16"),
    "float16": (["--dtype", "float16"], False, None),
    "secure-noise": (BF16 + ["--secure-noise"], False, None),
    "4bit": (BF16 + ["--quantize", "4bit"], False, None),
    "fsdp-bf16": (BF16 + ["--fsdp"], True, None),
    "fsdp-4bit": (BF16 + ["--fsdp", "--quantize", "4bit"], True, None),
}
ACCOUNTING = ("steps", "sample_rate", "noise_multiplier", "epsilon", "delta")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # the jobs' env


def write_data(folder: Path, n: int = 96, n_test: int = 4) -> Path:
    """A generated LLM-Adapters training file of ``n`` sums, and a GSM8K-style test set of its first ``n_test``
    beside it (the generation eval runs too); returns the training file's path."""
    folder.mkdir(parents=True, exist_ok=True)
    recs = [{"instruction": f"What is {i} plus {i + 1}?", "input": "", "output": f"The answer is {2 * i + 1}.",
             "answer": str(2 * i + 1)} for i in range(n)]
    (folder / "train.json").write_text(json.dumps(recs))
    (folder / "gsm8k_test.json").write_text(json.dumps(recs[:n_test]))
    return folder / "train.json"


def random_model(folder: Path, texts: list[str]) -> str:
    """A random-init Llama of SmolLM2-135M's shape (bf16) and a byte-level BPE tokenizer trained on ``texts``."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=600, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def job(args, data: Path, out: Path, flags: list[str], torchrun: bool, port: int) -> list[str]:
    launch = [sys.executable, "-m", "prismdp"] if not torchrun else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "prismdp"]
    model = ["--model", args.model] if args.model else []
    return launch + ["train", *model, "--task", "instruct", "--data", str(data), "--steps", str(args.steps),
                     "--batch-size", "16", "--micro-batch-size", "8", "--max-length", "96", "--rank", "8",
                     "--epsilon", "8", "--eval-examples", "4", "--max-new-tokens", "16", "--seed", "0",
                     "--device", args.device, "--output", str(out), *flags]


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_check(name: str, args, data: Path, work: Path, env: dict, done: dict) -> dict:
    flags, torchrun, reference = CHECKS[name]
    if torchrun and args.nproc < 2:
        return {"flags": flags, "torchrun": True, "seconds": 0, "status": "skipped",
                "problems": [f"--fsdp needs 2 processes, one GPU each; this host has {args.nproc}"]}
    out, log = work / name, work / f"{name}.log"
    cmd = job(args, data, out, flags, torchrun, 29600 + len(done))
    start = time.perf_counter()
    codes = []
    with open(log, "w") as f:
        def launch(command):
            return subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.timeout).returncode

        if name == "resume":  # the first segment stops half-way (its checkpoint), the second resumes from it
            codes.append(launch(cmd + ["--stop-after", str(args.steps // 2)]))
            cmd = cmd + ["--resume"]
        codes.append(launch(cmd))
    metrics = _metrics(out)
    result = {"flags": flags, "torchrun": torchrun, "seconds": round(time.perf_counter() - start, 1),
              "exit_codes": codes, "losses": [m["loss"] for m in metrics],
              "nonfinite_examples": sum(m.get("nonfinite") or 0 for m in metrics)}
    privacy = out / "privacy.json"
    problems = [f"exit code {c}" for c in codes if c != 0]
    if result["losses"] and not any(result["losses"]):  # every target token truncated away: nothing compared
        problems.append("no step had a supervised token (every loss 0 or empty): raise --max-length")
    if any(x is not None and not math.isfinite(x) for x in result["losses"]) or result["nonfinite_examples"]:
        problems.append(f"non-finite values: losses {result['losses']}, {result['nonfinite_examples']} examples "
                        "with a non-finite gradient (left out of the sums)")
    if privacy.is_file():
        result["privacy"] = {k: json.loads(privacy.read_text()).get(k) for k in ACCOUNTING}
    else:
        problems.append("no privacy.json")
    summary = out / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        result["evals"] = s.get("evals")
        result["peak_memory_mb"] = (s.get("train") or {}).get("peak_memory_mb")
    base = done.get("bf16")
    if base and base.get("privacy") and result.get("privacy") and result["privacy"] != base["privacy"]:
        problems.append(f"privacy.json {result['privacy']} differs from bf16's {base['privacy']}")
    if reference:
        ref = done.get(reference, {}).get("losses") or []
        mine = result["losses"]
        pairs = [(a, b) for a, b in zip(mine, ref) if a is not None and b is not None]
        if len(mine) != args.steps or len(ref) != args.steps or not pairs:
            problems.append(f"losses of {len(mine)} steps against {reference}'s {len(ref)}")
        else:
            gap = max(abs(a - b) for a, b in pairs)
            result["max_loss_gap_to_" + reference] = gap
            if gap > args.loss_tol:
                problems.append(f"losses differ from {reference}'s by up to {gap:.4g} (> {args.loss_tol})")
    if problems:
        result["tail"] = log.read_text(errors="replace").splitlines()[-25:]
    result["status"] = "passed" if not problems else "failed"
    result["problems"] = problems
    return result


def markdown(report: dict) -> str:
    lines = [f"# GPU paths: {report['device_name']} ({report['date']}, commit {report['commit']})", "",
             f"`{' '.join(report['command'])}`; torch {report['torch']}", "",
             "| check | status | seconds | final loss | epsilon | peak MB | notes |",
             "|---|---|---:|---:|---:|---:|---|"]
    for name, r in report["checks"].items():
        losses = [x for x in r.get("losses", []) if x is not None]
        eps = (r.get("privacy") or {}).get("epsilon")
        gaps = "; ".join(f"{k[4:]} {v:.3g}" for k, v in r.items() if k.startswith("max_loss_gap"))
        notes = "; ".join(filter(None, [gaps, *r.get("problems", [])]))
        lines.append(f"| {name} | {r['status']} | {r['seconds']} | {losses[-1] if losses else '-'} | "
                     f"{eps if eps is None else round(eps, 3)} | {r.get('peak_memory_mb') or '-'} | {notes} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks (bf16 runs first when a check "
                   "compares against it)")
    p.add_argument("--model", default=None, help="model folder, .gguf or Hub id, or 'random' (default: the "
                   "packaged SmolLM2)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--nproc", type=int, default=None, help="processes of the fsdp checks (default: the number of "
                   "GPUs; 2 on the CPU)")
    p.add_argument("--loss-tol", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=420, help="seconds per job")
    p.add_argument("--output", default="bench/results")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        p.error(f"unknown check(s) {unknown}; the checks are {list(CHECKS)}")
    if any(CHECKS[n][2] for n in names) or len(names) > 1:
        names = ["bf16"] + [n for n in names if n != "bf16"]
    args.names = names
    if args.nproc is None:
        args.nproc = torch.cuda.device_count() if args.device.startswith("cuda") else 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report = {"device_name": device_name, "date": time.strftime("%Y-%m-%d"), "commit": code_commit(),
              "torch": torch.__version__, "command": ["python", "-m", "bench.gpu_paths", *(argv or sys.argv[1:])],
              "checks": {}}
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpu-paths-{device_name.replace(' ', '-').lower()}"
    env = {**os.environ, **OFFLINE}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_data(Path(tmp) / "data")
        if args.model == "random":
            from prismdp.data.instruct import generate_prompt

            texts = [generate_prompt(r) + r["output"] for r in json.loads(data.read_text())]
            args.model = random_model(Path(tmp) / "random-model", texts)
        for name in args.names:
            try:
                report["checks"][name] = run_check(name, args, data, Path(tmp), env, report["checks"])
            except subprocess.TimeoutExpired:
                report["checks"][name] = {"status": "failed", "seconds": args.timeout,
                                          "problems": [f"timed out after {args.timeout} s"]}
            print(f"[gpu_paths] {name}: {report['checks'][name]['status']} "
                  f"{'; '.join(report['checks'][name]['problems'])}", flush=True)
            stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
            stem.with_suffix(".md").write_text(markdown(report))
    return sum(r["status"] == "failed" for r in report["checks"].values())


if __name__ == "__main__":
    sys.exit(main())
