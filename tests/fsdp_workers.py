"""Worker functions for tests/test_fsdp.py (importable by spawned processes): a tiny Llama whose frozen base is sharded
across gloo ranks with FSDP2, trained on fixed logical batches."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_workers import _close, _init  # noqa: E402

N, T = 24, 6


def _batches():
    """Six fixed logical batches; the first holds only even examples, so rank 1 of 2 has nothing to compute and runs
    idle micro-steps beside rank 0's."""
    g = torch.Generator().manual_seed(5)
    rest = [torch.nonzero(torch.rand(N, generator=g) < 0.3).flatten().tolist() for _ in range(5)]
    return [[0, 2, 4, 6]] + rest


def trajectory(rank: int, world_size: int, init_file: str, out: str, method: str, shard: bool) -> None:
    """Train in float64 (each rank its shard of every batch, micro-batches of 2 through the library's micro-step loop);
    rank 0 saves the trained tensors after every step, each rank what it holds of one frozen weight."""
    try:
        from helpers import tiny_llama

        from prismdp.engine import make_private
        from prismdp.losses import causal_lm_losses
        from prismdp.sharding import is_sharded, shard_frozen_base
        from prismdp.train.step import backward_micro_batches, micro_batch_plan

        world = _init(rank, world_size, init_file) if world_size > 1 else None
        model = tiny_llama(r=2, targets=("q_proj", "v_proj", "down_proj")).double()
        full_q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
        if shard:
            shard_frozen_base(model, world)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(1, 120, (N, T), generator=g)
        labels = ids.clone()
        labels[::3, :2] = -100  # some prompt tokens masked
        private = make_private(model, method=method, lr=5e-2, dataset_size=N, batch_size=8, steps=10 ** 6,
                               noise_multiplier=1.0, max_grad_norm=0.5, seed=7, world=world)

        def losses_of(micro):
            return causal_lm_losses(model(input_ids=ids[micro]).logits, labels[micro])

        traj = []
        model.train()
        for batch in _batches():
            mine = [i for i in batch if world is None or i % world.size == world.rank]
            backward_micro_batches(private, micro_batch_plan(mine, None, 2, group_by_length=False), losses_of)
            private.step()
            traj.append([p.detach().clone() for p in model.parameters() if p.requires_grad])
        private.check_replicas(len(traj))
        q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
        local = q.to_local() if is_sharded(q) else q
        info = {"lockstep": private.lockstep, "sharded": is_sharded(q), "local_rows": int(local.shape[0]),
                "full_rows": int(full_q.shape[0]), "trained_sharded": any(is_sharded(p) for p in
                                                                         model.parameters() if p.requires_grad)}
        torch.save({"traj": traj, "info": info}, out + f".{rank}")
        _close()
    except Exception:  # noqa: BLE001
        Path(out + f".err{rank}").write_text(traceback.format_exc())
        raise


def dies_after(rank: int, world_size: int, init_file: str, out: str, step: int) -> None:
    """Rank 1 exits abruptly in its first micro-step from step ``step`` on; rank 0, inside FSDP's all-gather of a
    forward, must fail with :class:`prismdp.distributed.PeerLostError`, not hang or raise gloo's own error."""
    import json
    import os

    from helpers import tiny_llama

    from prismdp.engine import make_private
    from prismdp.losses import causal_lm_losses
    from prismdp.sharding import shard_frozen_base
    from prismdp.train.step import backward_micro_batches, micro_batch_plan

    world = _init(rank, world_size, init_file, timeout_s=120.0)
    model = tiny_llama(r=2)
    shard_frozen_base(model, world)
    ids = torch.randint(1, 120, (N, T), generator=torch.Generator().manual_seed(1))
    private = make_private(model, method="prism", lr=1e-2, dataset_size=N, batch_size=8, steps=50,
                           noise_multiplier=1.0, seed=7, world=world)
    def losses_of(micro, t):
        if rank == 1 and t >= step:  # inside a micro-step, after the ranks agreed on their number
            os._exit(3)
        return causal_lm_losses(model(input_ids=ids[micro]).logits, ids[micro])

    try:
        for t, batch in enumerate(private.batches()):
            backward_micro_batches(private, micro_batch_plan(batch.tolist(), None, 2, group_by_length=False),
                                   lambda micro: losses_of(micro, t))
            private.step()
        Path(out + f".done{rank}").write_text("finished")
    except Exception as e:  # noqa: BLE001
        Path(out + f".err{rank}").write_text(json.dumps({"type": type(e).__name__, "msg": str(e)}))
