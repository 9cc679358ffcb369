"""Several processes, one private run: gloo processes on the CPU against one process (issue 12's checks)."""

import json
import math
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dist_workers

HERE = Path(__file__).parent


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
def test_two_processes_follow_the_one_process_trajectory(tmp_path, method):
    """The same logical batches, split across two gloo ranks: clipped sums all-reduced, the same noise drawn once from
    the shared stream: the float64 trajectory equals the one-process run's to 1e-10 (summation order only)."""
    one = tmp_path / "one.pt"
    dist_workers.trajectory(0, 1, "", str(one), method, 1.0)
    two = tmp_path / "two.pt"
    codes = _spawn(dist_workers.trajectory, 2, tmp_path, str(two), method, 1.0)
    errs = list(tmp_path.glob("two.pt.err*"))
    assert codes == [0, 0], errs[0].read_text() if errs else codes
    a, b = torch.load(one), torch.load(two)
    moved = float((a[-1][0] - a[0][0]).abs().max())
    assert moved > 1e-3
    for step_a, step_b in zip(a, b):
        for x, y in zip(step_a, step_b):
            torch.testing.assert_close(y, x, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("secure", [False, True])
def test_noise_is_added_once_not_once_per_process(tmp_path, secure):
    """Two ranks, empty batches for 400 steps: the released gradient has per-coordinate std sigma C / (q N), not
    sqrt(2) times it, and is the same on both ranks (secure: from rank 0's ChaCha20 key, broadcast once)."""
    out = tmp_path / "noise"
    codes = _spawn(dist_workers.noise_only, 2, tmp_path, str(out), 400, secure)
    errs = list(tmp_path.glob("noise.err*"))
    assert codes == [0, 0], errs[0].read_text() if errs else codes
    r0, r1 = torch.load(str(out) + ".0"), torch.load(str(out) + ".1")
    assert torch.equal(r0, r1)
    tau = 2.0 * 0.5 / 10.0
    std = float(r0.std())
    assert std == pytest.approx(tau, rel=0.03)  # sqrt(2) tau would be 41 % off
    assert abs(float(r0.mean())) < 5 * tau / math.sqrt(r0.numel())


def test_ranks_that_diverge_are_detected_on_every_rank(tmp_path):
    """After a relative 1e-6 change to one rank's copy of a factor, the replica check fails on both ranks (naming the
    step); before it, the copies are bitwise identical."""
    out = tmp_path / "div"
    codes = _spawn(dist_workers.diverges, 2, tmp_path, str(out))
    assert codes == [0, 0]
    for r in (0, 1):
        outcome = json.loads(Path(f"{out}.{r}").read_text())
        assert outcome["1"] == outcome["2"] == "same"
        assert "after step 3 the processes' trained tensors differ" in outcome["3"]


def test_a_killed_rank_gives_a_clear_error_not_a_hang(tmp_path):
    out = tmp_path / "kill"
    t0 = time.time()
    codes = _spawn(dist_workers.dies_after, 2, tmp_path, str(out), 3, timeout=150)
    assert codes[1] == 3
    err = json.loads((tmp_path / "kill.err0").read_text())
    assert err["type"] == "PeerLostError" and "stopped or lost its connection" in err["msg"]
    assert time.time() - t0 < 150


def _torchrun(nproc, args, env_extra=None, timeout=300, wait=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           **(env_extra or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-port",
           str(29500 + os.getpid() % 1000), "-m", "prismdp", "train", *args]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def test_torchrun_run_reports_the_same_privacy_as_one_process_and_survives_empty_local_batches(tiny_bert_dir,
                                                                                                tmp_path):
    """privacy.json of `torchrun --nproc-per-node 2 -m prismdp train` equals the one-process run's (world_size
    aside); q = 1 / 96 makes most local batches empty and the run still finishes.  SIGINT to one worker only (rank 1;
    torchrun forwards a Ctrl-C to every worker, a scheduler may signal any one) stops both ranks after the same step,
    with a checkpoint there (checkpoint_every 100 never fires), instead of a hang or a lost peer; a resume with the
    same world size continues, a different one is refused."""
    from helpers import interrupt_when_logged

    from prismdp.cli import main

    def rank1_pid(torchrun_pid):  # the worker started by torchrun with RANK=1
        deadline = time.time() + 300
        while time.time() < deadline:
            for d in Path("/proc").iterdir():
                try:
                    if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == torchrun_pid \
                            and b"RANK=1" in (d / "environ").read_bytes().split(b"\0"):
                        return int(d.name)
                except (OSError, IndexError, ValueError):
                    continue
            time.sleep(0.1)
        raise AssertionError("no rank-1 worker found")

    common = ["--model", tiny_bert_dir, "--synthetic-train", "96", "--synthetic-test", "16", "--steps", "20",
              "--batch-size", "1", "--micro-batch-size", "4", "--rank", "2", "--alpha", "4", "--max-length", "16",
              "--lr", "1e-2", "--quiet", "--checkpoint-every", "100"]
    assert main(["train", *common, "--output", str(tmp_path / "one")]) == 0
    two = tmp_path / "two"
    proc = _torchrun(2, [*common, "--output", str(two)], wait=False)
    interrupt_when_logged(two / "metrics.jsonl", 2, pid=rank1_pid(proc.pid))
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # ranks that stop after different steps wait for each other's collectives
        proc.terminate()  # torchrun passes it on to its workers and kills them 30 s later
        proc.communicate(timeout=120)
        raise AssertionError("the ranks did not stop together: a hang")
    stopped = torch.load(two / "checkpoint.pt", weights_only=False)["step"]
    assert 2 <= stopped < 20 and f"stopped after step {stopped} of 20 (a stop request to another process)" in err, \
        err[-3000:]
    assert len((two / "metrics.jsonl").read_text().splitlines()) == stopped
    assert "PeerLostError" not in err and "ReplicaDivergenceError" not in err, err[-3000:]
    res = _torchrun(2, [*common, "--output", str(tmp_path / "two"), "--resume"])
    assert res.returncode == 0, res.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "privacy.json").read_text())
    two = json.loads((tmp_path / "two" / "privacy.json").read_text())
    assert one.pop("world_size") == 1 and two.pop("world_size") == 2
    assert one == two
    assert json.loads((tmp_path / "two" / "config.json").read_text())["world_size"] == 2
    sizes = [json.loads(line)["batch_size"] for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len(sizes) == 20 and sum(n <= 1 for n in sizes) >= 2  # global batches of 0-1: a rank's was empty
    res = _torchrun(3, [*common, "--output", str(tmp_path / "two"), "--resume"])
    assert res.returncode != 0 and "same number" in res.stderr
