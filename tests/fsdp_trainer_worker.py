"""One process of `torchrun --nproc-per-node 2 tests/fsdp_trainer_worker.py MODEL_DIR OUT STEPS [FSDP]`
(tests/test_fsdp.py): PrivateTrainer on the tiny model of test_hf_trainer._setup with every dropout off (so that the
idle micro-steps of a sharded run, which draw no dropout mask that matters, leave the others' masks alike), with
TrainingArguments(fsdp=FSDP); saves the adapter and privacy.json (rank 0) and OUT/rank<r>.json with the trained
tensors' checksum."""

import functools
import json
import sys
from pathlib import Path

import torch

from prismdp.data.collate import pad_collate
from prismdp.integrations.hf import PrivacyArguments, PrivateTrainer
from test_hf_trainer import Rows, _setup, _targs


def main(model_dir: str, out: str, steps: int, fsdp: str = "") -> None:
    torch.set_num_threads(1)
    cfg, model, tok, data = _setup(model_dir)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    trainer = PrivateTrainer(model=model, args=_targs(out, max_steps=steps, fsdp=fsdp),
                             privacy_args=PrivacyArguments(target_epsilon=3.0, expected_batch_size=16),
                             train_dataset=Rows(data.train),
                             data_collator=functools.partial(pad_collate, pad_token_id=tok.pad_token_id))
    trainer.train()
    trainer.save_model()
    trained = [p.detach().double() for p in trainer.model.parameters() if p.requires_grad]
    rank = trainer.private.world.rank
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "checksum": sum(float(t.sum()) + float((t * t).sum()) for t in trained), "steps": trainer.state.global_step,
        "lockstep": trainer.private.lockstep}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
