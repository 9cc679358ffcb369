"""A frozen base sharded across processes with FSDP2 (``--fsdp``, prismdp.sharding): gloo processes on the CPU."""

import multiprocessing as mp
import time

import pytest
import torch

import fsdp_workers


def _spawn(fn, world, tmp_path, *args, timeout=240):
    ctx = mp.get_context("spawn")
    init = tmp_path / "init"
    procs = [ctx.Process(target=fn, args=(r, world, str(init), *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(1.0, deadline - time.time()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{len(alive)} process(es) still running after {timeout} s: a hang"
    return [p.exitcode for p in procs]


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_a_sharded_base_follows_the_one_process_trajectory(tmp_path, method):
    """Two gloo ranks, the tiny Llama's frozen weights sharded with FSDP2 (each rank holds half the rows of every
    block's weights), the LoRA factors whole on both: the float64 trajectory equals the unsharded one-process run's to
    1e-10 on the same logical batches (one of them empty on rank 1, which runs idle micro-steps beside rank 0's)."""
    one = tmp_path / "one"
    fsdp_workers.trajectory(0, 1, "", str(one), method, False)
    two = tmp_path / "two"
    codes = _spawn(fsdp_workers.trajectory, 2, tmp_path, str(two), method, True)
    errs = sorted(tmp_path.glob("two.err*"))
    assert codes == [0, 0], errs[0].read_text() if errs else codes
    a = torch.load(f"{one}.0")
    for r in (0, 1):
        b = torch.load(f"{two}.{r}")
        assert b["info"] == {"lockstep": True, "sharded": True, "local_rows": 16, "full_rows": 32,
                             "trained_sharded": False}
        assert len(b["traj"]) == len(a["traj"]) == 6
        for step_a, step_b in zip(a["traj"], b["traj"]):
            for x, y in zip(step_a, step_b):
                torch.testing.assert_close(y, x, rtol=1e-10, atol=1e-10)
    assert a["info"]["lockstep"] is False
    moved = float((a["traj"][-1][0] - a["traj"][0][0]).abs().max())
    assert moved > 1e-3


def test_a_killed_rank_gives_the_clear_error_inside_a_sharded_forward(tmp_path):
    """Rank 1 dies after 3 steps: rank 0, waiting in FSDP's all-gather, reports PeerLostError (the run's own error
    naming the lost peer and the resume), not gloo's RuntimeError or a hang."""
    import json

    out = tmp_path / "kill"
    t0 = time.time()
    codes = _spawn(fsdp_workers.dies_after, 2, tmp_path, str(out), 3, timeout=150)
    assert codes[1] == 3
    err = json.loads((tmp_path / "kill.err0").read_text())
    assert err["type"] == "PeerLostError" and "stopped or lost its connection" in err["msg"], err
    assert "sharded model" in err["msg"]
    assert time.time() - t0 < 150
