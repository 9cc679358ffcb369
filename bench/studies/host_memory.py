"""What ``prismdp train --fsdp`` costs in host memory: rank 0 reads the whole model, the other ranks build it on the
meta device and receive their shards (``prismdp.sharding.shard_from_rank0``).

1. *Reading*: a random-init Llama saved as safetensors in bf16 is loaded by ``prismdp.models.load_model`` in bf16
   (its own dtype) and in float32 (a conversion), each in a fresh process: the growth of the process's anonymous
   memory (RssAnon) and the share of the weights' bytes lying inside the file's memory mapping.
2. *Building*: ``build_run`` with ``fsdp=True`` on two gloo processes (torchrun), each sampling its RssAnon every
   3 ms: the peak during the build over the memory before it, per rank.

    PYTHONPATH=src python -m bench.studies.host_memory [--layers 8 --hidden 1024] [--output bench/results/host-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from prismdp.train.profile import status_kb

from ..gpu_paths import OFFLINE, write_data


def anon_mb() -> int:
    return status_kb("RssAnon") // 1024


def make_model(folder: Path, layers: int, hidden: int) -> dict:
    import transformers

    from prismdp.models import default_causal_lm

    source, gguf = default_causal_lm()
    tok = transformers.AutoTokenizer.from_pretrained(source, gguf_file=gguf)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=8, vocab_size=len(tok),
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    write_data(folder, 32)
    return {"parameters": sum(p.numel() for p in model.parameters()), "layers": layers, "hidden": hidden,
            "checkpoint_dtype": "bfloat16"}


def read(folder: str, dtype: str) -> dict:
    """In this process: load the model, report the anonymous-memory growth and the mapped share of its weights."""
    import transformers  # noqa: F401 - imported before the baseline

    from prismdp.models import load_model

    before = anon_mb()
    model, _ = load_model(folder, "causal_lm", dtype=getattr(torch, dtype))
    grown = anon_mb() - before
    regions = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith(".safetensors"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                regions.append((lo, hi))
    total = mapped = 0
    for p in model.parameters():
        size = p.numel() * p.element_size()
        total += size
        mapped += size * any(lo <= p.data_ptr() < hi for lo, hi in regions)
    return {"dtype": dtype, "weights_mb": total >> 20, "anon_growth_mb": grown, "share_in_file_mapping": mapped / total}


def build(folder: str, dtype: str) -> None:
    """Under torchrun: build_run with fsdp=True, sampling this rank's RssAnon; rank results to stdout as JSON."""
    import torch.distributed as dist

    from prismdp.distributed import World
    from prismdp.train.build import build_run
    from prismdp.train.config import TrainConfig

    dist.init_process_group("gloo")
    world = World()
    cfg = TrainConfig(model=folder, task="instruct", data=f"{folder}/train.json", steps=1, batch_size=8,
                      micro_batch_size=8, max_length=64, rank=8, target_modules=["q_proj", "v_proj"], epsilon=8,
                      seed=0, dtype=dtype, fsdp=True, output=f"{folder}/run-{dtype}")
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], anon_mb())
            time.sleep(0.003)

    before = anon_mb()
    sampler = threading.Thread(target=sample)
    sampler.start()
    build_run(cfg, world=world, log=lambda *a: None)
    stop.set()
    sampler.join()
    print("RESULT " + json.dumps({"rank": world.rank, "dtype": dtype, "anon_before_mb": before,
                                  "build_peak_growth_mb": peak[0] - before, "anon_after_mb": anon_mb()}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _results(cmd: list[str], env: dict) -> list[dict]:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--output", default="bench/results/host-memory")
    p.add_argument("--read", nargs=2, metavar=("FOLDER", "DTYPE"), help=argparse.SUPPRESS)
    p.add_argument("--build", nargs=2, metavar=("FOLDER", "DTYPE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.read:
        print("RESULT " + json.dumps(read(*args.read)), flush=True)
        return
    if args.build:
        build(*args.build)
        return
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        result = {"model": make_model(folder, args.layers, args.hidden), "read": [], "build": []}
        for dtype in ("bfloat16", "float32"):
            result["read"] += _results([sys.executable, "-m", "bench.studies.host_memory", "--read", tmp, dtype], env)
            result["build"] += _results([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                         "--master-addr", "127.0.0.1", "--master-port", "29561", "-m",
                                         "bench.studies.host_memory", "--build", tmp, dtype], env)
    result["torch"], result["date"] = torch.__version__, time.strftime("%Y-%m-%d")
    import transformers

    result["transformers"] = transformers.__version__
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
