"""One process of a `torchrun --nproc-per-node 2` run of PrivateTrainer (tests/test_hf_trainer.py):

    python -m torch.distributed.run --nproc-per-node 2 tests/hf_dist_worker.py MODEL_DIR OUT STEPS

Trains the tiny model of test_hf_trainer._setup privately for STEPS steps, saves the adapter and privacy.json (rank 0),
and writes OUT/rank<r>.json: the trained tensors' checksum and, per backward pass, the gradient autograd left in a
LoRA factor's .grad before the mechanism discarded it (DDP must not have averaged it across the ranks)."""

import functools
import json
import sys
from pathlib import Path

import torch

from prismdp.data.collate import pad_collate
from prismdp.integrations.hf import PrivacyArguments, PrivateTrainer
from test_hf_trainer import Rows, _setup, _targs


def main(model_dir: str, out: str, steps: int) -> None:
    torch.set_num_threads(1)
    cfg, model, tok, data = _setup(model_dir)
    trainer = PrivateTrainer(model=model, args=_targs(out, max_steps=steps),
                             privacy_args=PrivacyArguments(target_epsilon=3.0, expected_batch_size=16),
                             train_dataset=Rows(data.train),
                             data_collator=functools.partial(pad_collate, pad_token_id=tok.pad_token_id))
    private = trainer.private
    probe = private.pairs[0].lora_B.weight
    grads = []
    collect = private.grad_sampler.collect

    def recording_collect():  # test instrumentation: what autograd (and DDP, if it were active) left in .grad
        grads.append(probe.grad.detach().flatten()[:8].tolist())
        return collect()

    private.grad_sampler.collect = recording_collect
    trainer.train()
    trainer.save_model()
    trained = [p.detach().double() for p in trainer.model.parameters() if p.requires_grad]
    checksum = sum(float(t.sum()) + float((t * t).sum()) for t in trained)
    rank = private.world.rank if private.world is not None else 0
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "world_size": private.world.size if private.world is not None else 1, "checksum": checksum,
        "grads": grads, "steps": trainer.state.global_step}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
