"""One process of a `torchrun --nproc-per-node 2` run of PrivateTrainer (tests/test_hf_trainer.py):

    python -m torch.distributed.run --nproc-per-node 2 tests/hf_dist_worker.py MODEL_DIR OUT METHOD[,METHOD...]

Trains test_hf_trainer.float64_trainer (float64, fixed logical batches, this rank's share of each) for STEPS steps (per method, in OUT/METHOD),
with a 60 s collective timeout (a rank waiting for a collective its peer never joins fails instead of hanging);
saves the adapter and privacy.json (rank 0), OUT/rank<r>.pt (the trained tensors) and OUT/rank<r>.json: per
backward pass, the gradient autograd left in a LoRA factor's .grad before the mechanism discarded it (DDP must
not have averaged it across the ranks)."""

import json
import os
import sys
from pathlib import Path

import torch

from prismdp.distributed import init_from_env
from test_hf_trainer import float64_trainer

STEPS = 4


def main(model_dir: str, out: str, methods: str) -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # the group first, with a 60 s collective timeout: TrainingArguments passes ddp_timeout on only off the CPU
    # (transformers 5.24, use_cpu=True: gloo's default of 30 minutes); the Trainer then uses this group
    init_from_env(timeout_s=60)
    for method in methods.split(","):  # one launch, several runs (each start costs more than its training)
        train(model_dir, str(Path(out, method)), method, rank, world)


def train(model_dir: str, out: str, method: str, rank: int, world: int) -> None:
    trainer = float64_trainer(model_dir, out, STEPS, method, rank=rank, world=world)
    private = trainer.private
    assert private.world is not None and private.world.rank == rank
    probe = private.pairs[0].lora_B.weight
    # test instrumentation: autograd's summed .grad of the factors too (training skips it), so that an all-reduce of
    # .grad by DDP would show; the one-process run it is compared with skips it
    private.grad_sampler.summed_lora_grads = True
    grads = []
    collect = private.grad_sampler.collect

    def recording_collect():  # test instrumentation: what autograd (and DDP, if it were active) left in .grad
        grads.append(probe.grad.detach().flatten()[:8].tolist())
        return collect()

    private.grad_sampler.collect = recording_collect
    trainer.train()
    trainer.save_model()
    torch.save([p.detach() for p in trainer.model.parameters() if p.requires_grad], Path(out, f"rank{rank}.pt"))
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "world_size": private.world.size, "grads": grads, "steps": trainer.state.global_step}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
