"""Worker functions for tests/test_distributed.py (importable by spawned processes)."""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch


def _init(rank: int, world: int, init_file: str, timeout_s: float = 180.0):
    """Join the gloo group.  The collective timeout is 180 s, below spawn_workers' 240 s bound (a hang still fails),
    a margin for loaded machines.  It does not explain test_fsdp's sharded-NF4 trajectory failing under load (rank 0
    exit -6, rank 1 a lost connection): that recurred at 180 s, later in the run, so its cause is still open."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    from prismdp.distributed import World

    return World()


def _close() -> None:
    """Leave the group together: without it one process's gloo threads can abort ("terminate called without an active
    exception", exit -6) while its peer is already tearing down."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _batches(n_steps: int, dataset: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return [torch.nonzero(torch.rand(dataset, generator=g) < 0.3).flatten().tolist() for _ in range(n_steps)]


def trajectory(rank: int, world_size: int, init_file: str, out: str, method: str, sigma: float) -> None:
    """Train tiny_net in float64 on fixed logical batches (each rank its shard of every batch); save the factors
    after every step (rank 0) and each rank's final checksum."""
    try:
        sys.path.insert(0, str(Path(__file__).parent))
        from helpers import net_batch, tiny_net

        from prismdp.engine import make_private
        from prismdp.losses import classification_losses

        world = _init(rank, world_size, init_file) if world_size > 1 else None
        X, Y = net_batch(40, seed=1, dtype=torch.float64)
        X[3] *= 50  # clipped
        model = tiny_net(seed=0, dtype=torch.float64)
        private = make_private(model, method=method, lr=5e-2, dataset_size=40, batch_size=12, steps=10 ** 6,
                               noise_multiplier=sigma, max_grad_norm=0.5, seed=7, world=world)
        traj = []
        for batch in _batches(6, 40):
            mine = [i for i in batch if world is None or i % world.size == world.rank]
            for k in range(0, len(mine), 3):
                mb = mine[k:k + 3]
                private.backward(classification_losses(model(X[mb]), Y[mb]))
            private.step()
            traj.append([p.detach().clone() for p in model.parameters() if p.requires_grad])
        private.check_replicas(6)
        if rank == 0:
            torch.save(traj, out)
        _close()
    except Exception:  # noqa: BLE001
        Path(out + f".err{rank}").write_text(traceback.format_exc())
        raise


def noise_only(rank: int, world_size: int, init_file: str, out: str, steps: int, secure: bool = False) -> None:
    """DP-AdamW with no examples at all: the released gradient is pure noise; each rank saves it per step
    (``secure``: --secure-noise, the ChaCha20 key drawn by rank 0 and broadcast)."""
    try:
        sys.path.insert(0, str(Path(__file__).parent))
        from helpers import tiny_net

        from prismdp.engine import make_private

        world = _init(rank, world_size, init_file)
        model = tiny_net(seed=0)
        private = make_private(model, method="dp-adamw", lr=1e-3, dataset_size=100, batch_size=10, steps=10 ** 6,
                               noise_multiplier=2.0, max_grad_norm=0.5, seed=None if secure else 3, world=world,
                               secure_noise=secure)
        released = []
        private.optimizer.attach_step_hook(lambda rec: released.append(torch.cat([v.flatten() for v in rec.release.values])))
        for _ in range(steps):
            private.step()
        private.check_replicas(steps)
        torch.save(torch.stack(released), out + f".{rank}")
        _close()
    except Exception:  # noqa: BLE001
        Path(out + f".err{rank}").write_text(traceback.format_exc())
        raise


def dies_after(rank: int, world_size: int, init_file: str, out: str, step: int) -> None:
    """Rank 1 exits abruptly after ``step`` steps; rank 0 must fail with a clear error, not hang."""
    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import net_batch, tiny_net

    from prismdp.engine import make_private
    from prismdp.losses import classification_losses

    world = _init(rank, world_size, init_file, timeout_s=120.0)
    X, Y = net_batch(40, seed=1)
    model = tiny_net(seed=0)
    private = make_private(model, method="prism", lr=1e-2, dataset_size=40, batch_size=12, steps=50,
                           noise_multiplier=1.0, seed=7, world=world)
    try:
        for t, batch in enumerate(private.batches()):
            if rank == 1 and t == step:
                os._exit(3)
            if len(batch):
                private.backward(classification_losses(model(X[batch]), Y[batch]))
            private.step()
        Path(out + f".done{rank}").write_text("finished")
    except Exception as e:  # noqa: BLE001
        Path(out + f".err{rank}").write_text(json.dumps({"type": type(e).__name__, "msg": str(e)}))


def diverges(rank: int, world_size: int, init_file: str, out: str) -> None:
    """Two ranks train identically for 2 steps; then rank 1's copy of one factor is nudged by a relative 1e-6 (what a
    rank running other code or another seed would produce); check_replicas must fail on every rank."""
    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import net_batch, tiny_net

    from prismdp.distributed import ReplicaDivergenceError
    from prismdp.engine import make_private
    from prismdp.losses import classification_losses

    world = _init(rank, world_size, init_file)
    X, Y = net_batch(40, seed=1)
    model = tiny_net(seed=0)
    private = make_private(model, method="prism", lr=1e-2, dataset_size=40, batch_size=12, steps=4,
                           noise_multiplier=1.0, seed=7, world=world)
    outcome = {}
    for t, batch in enumerate(private.batches()):
        if len(batch):
            private.backward(classification_losses(model(X[batch]), Y[batch]))
        private.step()
        try:
            private.check_replicas(t + 1)
            outcome[t + 1] = "same"
        except ReplicaDivergenceError as e:
            outcome[t + 1] = str(e)
            break
        if t == 1 and rank == 1:
            with torch.no_grad():
                private.pairs[0].lora_A.weight.view(-1)[0] *= 1 + 1e-6  # one float32 ulp or a few
    Path(out + f".{rank}").write_text(json.dumps(outcome))
    _close()


def sampled_indices(rank: int, world_size: int, init_file: str, out: str, n: int, batch: int, steps: int) -> None:
    """Each rank's Poisson batches exactly as ``make_private`` draws them (seeded, and with --secure-noise), as a
    (steps, n) inclusion matrix of global example indices; no training."""
    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import tiny_net

    from prismdp.engine import make_private

    world = _init(rank, world_size, init_file)
    drawn = {}
    for kind, kw in (("seeded", {"seed": 7}), ("secure", {"seed": None, "secure_noise": True})):
        private = make_private(tiny_net(seed=0), method="dp-adamw", lr=1e-3, dataset_size=n, batch_size=batch,
                               steps=steps, noise_multiplier=1.0, world=world, **kw)
        x = torch.zeros(steps, n, dtype=torch.bool)
        for t, indices in enumerate(private.batches()):
            x[t, indices] = True
        drawn[kind] = x
    torch.save(drawn, out + f".{rank}")
    _close()


# ---------------------------------------------------------------- a frozen base sharded with FSDP2 (test_fsdp.py)

FSDP_N, FSDP_T = 24, 6


def _fsdp_batches():
    """Six fixed logical batches; the first holds only even examples, so rank 1 of 2 has nothing to compute and runs
    idle micro-steps beside rank 0's."""
    g = torch.Generator().manual_seed(5)
    rest = [torch.nonzero(torch.rand(FSDP_N, generator=g) < 0.3).flatten().tolist() for _ in range(5)]
    return [[0, 2, 4, 6]] + rest


def fsdp_trajectory(rank: int, world_size: int, init_file: str, out: str, method: str, shard: bool,
                    nf4: bool = False) -> None:
    """Train in float64 (each rank its shard of every batch, micro-batches of 2 through the library's micro-step loop);
    rank 0 saves the trained tensors after every step, each rank what it holds of one frozen weight.  ``nf4``: the
    blocks' frozen linear weights held in torchao's NF4 (sized for 2 shards, sharded or not)."""
    try:
        from helpers import tiny_llama

        from prismdp.engine import make_private
        from prismdp.losses import causal_lm_losses
        from prismdp.quantized import is_nf4, quantize_nf4_layers
        from prismdp.sharding import is_sharded, shard_frozen_base
        from prismdp.train.step import backward_micro_batches, micro_batch_plan

        world = _init(rank, world_size, init_file) if world_size > 1 else None
        model = tiny_llama(r=2, targets=("q_proj", "v_proj", "down_proj")).double()
        full_q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
        unwaited = read_equal = None
        if shard:
            from torch._C._distributed_c10d import _get_work_registry_size

            from prismdp.sharding import full_weight

            shard_frozen_base(model, world, quantize="nf4" if nf4 else None)
            q_weight = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
            gathered = full_weight(q_weight)
            unwaited = _get_work_registry_size()  # gathers still writing into the tensor full_weight returned
            if nf4:  # the NF4 read (a synchronous gather of de-quantized rows) is the full tensor's de-quantization
                from prismdp.base.nf4 import dequantized

                read_equal = torch.equal(dequantized(q_weight), gathered.get_original_weight())
        elif nf4:
            quantize_nf4_layers(model, 2, keep={"lm_head"})
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(1, 120, (FSDP_N, FSDP_T), generator=g)
        labels = ids.clone()
        labels[::3, :2] = -100  # some prompt tokens masked
        private = make_private(model, method=method, lr=5e-2, dataset_size=FSDP_N, batch_size=8, steps=10 ** 6,
                               noise_multiplier=1.0, max_grad_norm=0.5, seed=7, world=world)

        def losses_of(micro):
            return causal_lm_losses(model(input_ids=ids[micro]).logits, labels[micro])

        traj = []
        model.train()
        for batch in _fsdp_batches():
            mine = [i for i in batch if world is None or i % world.size == world.rank]
            backward_micro_batches(private, micro_batch_plan(mine, None, 2, group_by_length=False), losses_of)
            private.step()
            traj.append([p.detach().clone() for p in model.parameters() if p.requires_grad])
        private.check_replicas(len(traj))
        q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
        local = q.to_local() if is_sharded(q) else q
        info = {"lockstep": private.lockstep, "sharded": is_sharded(q), "local_rows": int(local.shape[0]),
                "full_rows": int(full_q.shape[0]), "trained_sharded": any(is_sharded(p) for p in
                                                                         model.parameters() if p.requires_grad),
                "nf4": sum(is_nf4(p) for p in model.parameters()), "unwaited": unwaited,
                "nf4_read_equal": read_equal}
        torch.save({"traj": traj, "info": info}, out + f".{rank}")
        _close()
    except Exception:  # noqa: BLE001
        Path(out + f".err{rank}").write_text(traceback.format_exc())
        raise


def fsdp_dies_after(rank: int, world_size: int, init_file: str, out: str, step: int) -> None:
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
    ids = torch.randint(1, 120, (FSDP_N, FSDP_T), generator=torch.Generator().manual_seed(1))
    private = make_private(model, method="prism", lr=1e-2, dataset_size=FSDP_N, batch_size=8, steps=50,
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


def _whole_tensor_bytes() -> int:
    """Bytes of the plain tensors alive in this process (found by the garbage collector), the meta ones and the
    storage of every DTensor's local shard left out: what a process holds whole besides its shards."""
    import gc

    from torch.distributed.tensor import DTensor

    def plain(t):  # a tensor with a storage of its own (not a subclass wrapping others: DTensor, torchao's NF4)
        return type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta

    objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    shards = {o._local_tensor.untyped_storage().data_ptr() for o in objects
              if isinstance(o, DTensor) and plain(o._local_tensor)}
    storages = {}
    for o in objects:
        if not plain(o):
            continue
        storage = o.untyped_storage()
        if storage.data_ptr() not in shards:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def fsdp_build(rank: int, world_size: int, init_file: str, out: str, cfg: dict) -> None:
    """``build_run`` of ``cfg`` (fsdp on) counting the weight reads (``from_pretrained``) of this rank; saves its
    count, the model's full tensors (gathered), its buffers and the random state after the build, the bytes held
    whole (:func:`_whole_tensor_bytes`) as each FSDP unit was about to be sharded (``fully_shard`` wrapped) and the
    dtype in which rank 0 read the frozen base (``shard_from_rank0`` wrapped)."""
    try:
        import torch.distributed.fsdp as fsdp
        from transformers import modeling_utils

        from prismdp.quantized import is_nf4
        from prismdp.sharding import full_weight
        from prismdp.base import sharded
        from prismdp.train.build import build_run
        from prismdp.train.config import TrainConfig

        reads = []
        real = modeling_utils.PreTrainedModel.from_pretrained.__func__

        def counting(cls, *a, **k):
            reads.append(cls.__name__)
            return real(cls, *a, **k)

        modeling_utils.PreTrainedModel.from_pretrained = classmethod(counting)
        held, shard = [], fsdp.fully_shard

        @functools.wraps(shard)  # keeps fully_shard's signature: --fsdp checks it has ignored_params
        def measuring(module, **kw):
            held.append((type(module).__name__, _whole_tensor_bytes()))
            return shard(module, **kw)

        fsdp.fully_shard = measuring
        whole_dtypes, send = [], sharded.shard_from_rank0

        def sending(model, world, whole, **kw):  # the dtype of the frozen base rank 0 read
            if whole is not None:
                whole_dtypes.append(whole.get_base_model().get_input_embeddings().weight.dtype)
            return send(model, world, whole, **kw)

        sharded.shard_from_rank0 = sending
        world = _init(rank, world_size, init_file)
        run = build_run(TrainConfig(**cfg), world=world, log=lambda *a: None)
        from prismdp.base.nf4 import dequantized

        # NF4 read as prismdp reads it (rows de-quantized, gathered synchronously); the rest gathered whole
        state = {k: (dequantized(v) if is_nf4(v) else full_weight(v)).detach().clone()
                 for k, v in run.model.state_dict().items()}
        buffers = {k: v.detach().clone() for k, v in run.model.named_buffers()}
        nf4 = sorted(k for k, v in run.model.state_dict().items() if is_nf4(v))
        torch.save({"reads": reads, "state": state, "buffers": buffers, "rng": torch.get_rng_state(), "nf4": nf4,
                    "held": held, "whole_dtypes": whole_dtypes}, out + f".{rank}")
        _close()
    except Exception:  # noqa: BLE001
        Path(out + f".err{rank}").write_text(traceback.format_exc())
        raise


def fsdp_tied_across_units(rank: int, world_size: int, init_file: str, out: str) -> None:
    """shard_from_rank0 on a model whose two blocks share one weight; saves the error it raises."""
    from torch import nn

    from prismdp.sharding import shard_from_rank0

    class Block(nn.Module):
        def __init__(self, lin=None):
            super().__init__()
            self.lin = lin if lin is not None else nn.Linear(4, 4)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Block()
            self.b = Block(nn.Linear(4, 4))
            self.b.lin.weight = self.a.lin.weight

    world = _init(rank, world_size, init_file)
    with torch.device("meta"):
        skeleton = Tied()
    whole = Tied() if rank == 0 else None
    try:
        shard_from_rank0(skeleton, world, whole, blocks=["Block"])
        Path(out + f".{rank}").write_text("no error")
    except Exception as e:  # noqa: BLE001
        Path(out + f".{rank}").write_text(f"{type(e).__name__}: {e}")
    del skeleton, whole
    _close()


def crash_once(rank: int, world_size: int, init_file: str, marker: str, how: str) -> None:
    """Rank 1 fails once (``how``: ``abort``, a native crash, or ``error``, a Python error) and leaves ``marker``;
    run again, every rank succeeds (tests helpers.worker_codes' retry)."""
    if rank == 1 and not Path(marker).exists():
        Path(marker).touch()
        if how == "abort":
            os.abort()
        raise ValueError("a Python error, not a native crash")


def main(argv: list[str]) -> None:
    """``python -c 'import dist_workers; dist_workers.main(sys.argv[1:])' fn rank world init_file args_json``: run
    ``fn(rank, world, init_file, *args)`` and leave through ``os._exit`` (0, or 1 after printing the traceback),
    skipping the interpreter's teardown. Twice in the fresh-clone CI, under load, a finished FSDP worker exited -6
    (SIGABRT; once after writing its result, once with no stderr kept), presumably in that teardown, where FSDP and
    gloo objects are freed in arbitrary order after the group was destroyed (not reproduced in 42 runs here); the
    exit code is then about the work, not about the order of finalizers."""
    fn, rank, world, init_file, args = argv
    code = 0
    try:
        globals()[fn](int(rank), int(world), init_file, *json.loads(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 (printed, then the exit code says it)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
