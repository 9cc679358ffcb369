"""Several processes, one private run: gloo processes on the CPU against one process (issue 12's checks)."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

import dist_workers
from helpers import (Spawned, cross_rank_p_values, poisson_law_p_values, spawn_workers, torchrun,
                     torchrun_cmd, worker_codes)

HERE = Path(__file__).parent


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_two_processes_follow_the_one_process_trajectory(tmp_path, method):
    """The same logical batches, split across two gloo ranks: clipped sums all-reduced, the same noise drawn once from
    the shared stream: the float64 trajectory equals the one-process run's to 1e-10 (summation order only)."""
    one = tmp_path / "one.pt"
    dist_workers.trajectory(0, 1, "", str(one), method, 1.0)
    two = tmp_path / "two.pt"
    codes = worker_codes(dist_workers.trajectory, 2, tmp_path, str(two), method, 1.0)
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
    codes = worker_codes(dist_workers.noise_only, 2, tmp_path, str(out), 400, secure)
    errs = list(tmp_path.glob("noise.err*"))
    assert codes == [0, 0], errs[0].read_text() if errs else codes
    r0, r1 = torch.load(str(out) + ".0"), torch.load(str(out) + ".1")
    assert torch.equal(r0, r1)
    tau = 2.0 * 0.5 / 10.0
    std = float(r0.std())
    assert std == pytest.approx(tau, rel=0.03)  # sqrt(2) tau would be 41 % off
    assert abs(float(r0.mean())) < 5 * tau / math.sqrt(r0.numel())


def test_make_private_on_two_ranks_includes_every_example_independently(tmp_path):
    """The Poisson law as the global sampler sees it: two gloo processes, each with its own ``make_private`` (seeded,
    and with --secure-noise), 1000 steps over 200 examples at q = 0.1.  Each rank draws only its own examples (r, r + 2,
    ...) and the union is one Poisson sample: batch sizes Binomial(N, q), inclusion counts Binomial(T, q), all pairs
    uncorrelated, no lag-1/2 autocorrelation (helpers.poisson_law_p_values); neighbours on different ranks included
    together with probability q^2, no cross-rank correlation at lags -2..2, neither rank's stream a shifted copy of the
    other's (helpers.cross_rank_p_values).  Each of the 2 x 7 p-values must exceed 1e-6: a correct sampler fails with
    probability below 1.4e-5 (the secure streams are fresh on every run; the seeded ones are fixed).  Every rank
    seeded alike (examples 2k, 2k + 1 in or out together) gives p ~ 0 on the batch-size law, the pairs and the
    neighbours; rank 1's stream overlapping rank 0's one uniform, one step or ten steps later gives p ~ 0 on the pairs,
    the lags or the shifted copy."""
    n, batch, steps = 200, 20, 1000
    out = tmp_path / "drawn"
    runs = spawn_workers("sampled_indices", 2, tmp_path, str(out), n, batch, steps, timeout=240)
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    drawn = [torch.load(f"{out}.{r}") for r in (0, 1)]
    for kind in ("seeded", "secure"):
        x0, x1 = drawn[0][kind], drawn[1][kind]
        assert not x0[:, 1::2].any() and not x1[:, 0::2].any()  # each rank samples its own examples only
        p = {**poisson_law_p_values((x0 | x1).double(), batch / n),
             **cross_rank_p_values(x0[:, 0::2], x1[:, 1::2], batch / n)}
        assert min(p.values()) > 1e-6, (kind, p)


def test_ranks_that_diverge_are_detected_on_every_rank(tmp_path):
    """After a relative 1e-6 change to one rank's copy of a factor, the replica check fails on both ranks (naming the
    step); before it, the copies are bitwise identical."""
    out = tmp_path / "div"
    codes = worker_codes(dist_workers.diverges, 2, tmp_path, str(out))
    assert codes == [0, 0]
    for r in (0, 1):
        outcome = json.loads(Path(f"{out}.{r}").read_text())
        assert outcome["1"] == outcome["2"] == "same"
        assert "after step 3 the processes' trained tensors differ" in outcome["3"]


def test_a_killed_rank_gives_a_clear_error_not_a_hang(tmp_path):
    out = tmp_path / "kill"
    codes = worker_codes(dist_workers.dies_after, 2, tmp_path, str(out), 3, timeout=150)
    assert codes[1] == 3
    err = json.loads((tmp_path / "kill.err0").read_text())
    assert err["type"] == "PeerLostError" and "stopped or lost its connection" in err["msg"]  # within 150 s: bounded


def test_torchrun_run_reports_the_same_privacy_as_one_process_and_survives_empty_local_batches(tiny_bert_dir,
                                                                                                tmp_path):
    """privacy.json of `torchrun --nproc-per-node 2 -m prismdp train` equals the one-process run's (world_size
    aside); q = 1 / 96 makes most local batches empty and the run still finishes.  SIGINT to one worker only (rank 1;
    torchrun forwards a Ctrl-C to every worker, a scheduler may signal any one) stops both ranks after the same step,
    with a checkpoint there (checkpoint_every 100 never fires), instead of a hang or a lost peer; a resume with the
    same world size continues, a different one is refused."""
    from helpers import interrupt_when_logged

    from prismdp.cli import main

    common = ["--model", tiny_bert_dir, "--synthetic-train", "96", "--synthetic-test", "16", "--steps", "20",
              "--batch-size", "1", "--micro-batch-size", "4", "--rank", "2", "--alpha", "4", "--max-length", "16",
              "--lr", "1e-2", "--quiet", "--checkpoint-every", "100"]
    assert main(["train", *common, "--output", str(tmp_path / "one")]) == 0
    two = tmp_path / "two"
    with Spawned([torchrun_cmd(2, "-m", "prismdp", "train", *common, "--output", str(two))], tmp_path / "logs") as run:
        # SIGINT to the worker torchrun started with RANK=1; ranks that stopped after different steps would wait for
        # each other's collectives: the bounded wait kills torchrun and both workers and fails
        interrupt_when_logged(two / "metrics.jsonl", 2, pid=run.find("RANK=1"))
        err = run.wait(300)[0].stderr
    stopped = torch.load(two / "checkpoint.pt", weights_only=False)["step"]
    assert 2 <= stopped < 20 and f"stopped after step {stopped} of 20 (a stop request to another process)" in err, \
        err[-3000:]
    assert len((two / "metrics.jsonl").read_text().splitlines()) == stopped
    assert "PeerLostError" not in err and "ReplicaDivergenceError" not in err, err[-3000:]
    res = torchrun(2, ["-m", "prismdp", "train", *common, "--output", str(tmp_path / "two"), "--resume"], tmp_path,
                   timeout=300, name="resume2")
    assert res.returncode == 0, res.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "privacy.json").read_text())
    two = json.loads((tmp_path / "two" / "privacy.json").read_text())
    assert one.pop("world_size") == 1 and two.pop("world_size") == 2
    assert one == two
    assert json.loads((tmp_path / "two" / "config.json").read_text())["world_size"] == 2
    sizes = [json.loads(line)["batch_size"] for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len(sizes) == 20 and sum(n <= 1 for n in sizes) >= 2  # global batches of 0-1: a rank's was empty
    res = torchrun(3, ["-m", "prismdp", "train", *common, "--output", str(tmp_path / "two"), "--resume"], tmp_path,
                   timeout=300, name="resume3")
    assert res.returncode != 0 and "same number" in res.stderr


def test_a_hung_torchrun_is_killed_with_all_its_workers(tmp_path):
    """The tests' own safety net (helpers.Spawned): a torchrun whose two workers never finish fails the bounded wait
    with 'a hang', and afterwards no process of it is left: not torchrun, not its workers (which torchrun starts in
    sessions of their own, out of reach of a kill of torchrun's process group)."""
    from helpers import _tagged

    with Spawned([torchrun_cmd(2, "--no-python", "sleep", "600")], tmp_path / "logs") as run:
        workers = [run.find(f"RANK={r}") for r in (0, 1)]
        assert all(os.getsid(w) != os.getsid(run.procs[0].pid) for w in workers)  # what a group kill would miss
        with pytest.raises(AssertionError, match="still running after 1 s \\(a hang\\); all killed"):
            run.wait(1)
        assert not _tagged(run.tag)


def test_a_sigterm_outside_the_training_loop_is_taken_as_a_request_not_a_silent_death():
    """torchrun answers a dead rank with SIGTERM to the others, which used to kill a survivor silently outside the
    step loop.  Guarded: while starting (no process group yet) the survivor says why in one line and exits; once
    the group is up the SIGTERM is recorded, the process goes on (to print its lost-peer error at its next
    collective), and a training loop entered afterwards starts with the stop already requested."""
    from helpers import run_python

    starting = """if True:
        import os, signal, time
        from prismdp.train.interrupt import guard_termination
        guard_termination()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        print("still running")
    """
    res = run_python(starting, timeout=60, env={"RANK": "0", "WORLD_SIZE": "2"})
    assert res.returncode == 128 + 15 and res.stdout == "", (res.returncode, res.stderr[-2000:])
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("prismdp: error: rank 0 of 2: SIGTERM while the run was starting: another process of "
                           "the run stopped or lost its connection"), line
    running = """if True:
        import os, signal, tempfile
        import torch.distributed as dist
        from prismdp.train.interrupt import guard_termination, termination_requested
        from prismdp.train.interrupt import StopRequest
        guard_termination()
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert termination_requested() == "SIGTERM"
        with StopRequest(log=lambda m: None, escalate=False) as stop:
            assert stop.requested and stop.signame == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)  # after the loop: the guard again, not the default
        dist.destroy_process_group()
        print("alive")
    """
    res = run_python(running, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "alive", res.stderr[-2000:]


def test_a_sigterm_while_the_main_thread_is_blocked_in_a_collective_still_ends_the_process_with_one_line():
    """The CI failure of 2026-11-28: rank 1 was killed after a step and rank 0 printed nothing until torchrun's
    SIGKILL 30 s after its SIGTERM, because Python runs a signal handler only between the main thread's bytecodes
    and a main thread waiting inside C++ (a store wait, a collective that never sees its peer die) never returns to
    it.  The guard's watchdog thread wakes on the signal itself (signal.set_wakeup_fd) and ends the process with
    one error line: at once while starting, ``grace`` seconds after the SIGTERM once the process group is up (then
    with every thread's stack, to show where it was stuck).  Here
    the main thread waits 60 s in TCPStore.wait for a key nobody sets; without the watchdog the process runs the
    whole 60 s (checked: the handler ran only when the wait timed out)."""
    from helpers import run_python

    code = """if True:
        import datetime, os, signal, tempfile, threading, time
        import torch.distributed as dist
        from prismdp.train.interrupt import guard_termination
        guard_termination(grace=1.0)
        if {up}:
            dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        try:
            store.wait(["never set"])
        finally:
            print("main thread returned after", round(time.monotonic() - start), "s")
    """
    for up, says in ((False, "SIGTERM while the run was starting: another process of the run stopped or lost its "
                             "connection"),
                     (True, "SIGTERM 1 s ago and the run has not stopped: another process of the run stopped or "
                            "lost its connection")):
        res = run_python(code.format(up=up), timeout=50, env={"RANK": "0", "WORLD_SIZE": "2"})
        assert res.returncode == 128 + 15 and res.stdout == "", (up, res.returncode, res.stdout, res.stderr[-2000:])
        lines = [line for line in res.stderr.splitlines() if line.startswith("prismdp") and ": error: " in line]
        assert len(lines) == 1 and lines[0].startswith(f"prismdp: error: rank 0 of 2: {says}"), (up, lines)
        assert ("where each thread was" in res.stderr and "Thread 0x" in res.stderr) == up, res.stderr[-2000:]


def test_worker_codes_runs_the_workers_again_after_a_native_crash_only(tmp_path):
    """helpers.worker_codes(native_crash_retries=1), the sharded-NF4 tests' guard against a worker's heap-corruption
    abort: a SIGABRT of one worker runs them all again (with a warning) and the second run's codes count; without
    retries the -6 stays; a Python error (exit 1) is never run again."""
    from helpers import worker_codes

    assert worker_codes("crash_once", 2, tmp_path / "a", str(tmp_path / "a.marker"), "abort") == [0, -6]
    with pytest.warns(UserWarning, match="died of SIGABRT"):
        assert worker_codes("crash_once", 2, tmp_path / "b", str(tmp_path / "b.marker"), "abort",
                            native_crash_retries=1) == [0, 0]
    assert worker_codes("crash_once", 2, tmp_path / "c", str(tmp_path / "c.marker"), "error",
                        native_crash_retries=1) == [0, 1]


def test_init_from_env_sets_nccl_error_handling_and_the_timeout(monkeypatch):
    """Under NCCL: TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (abort the communicator, end the process) unless the user set
    it, and the process group's timeout from PRISMDP_DIST_TIMEOUT (default 300 s); a bad value is a one-line error."""
    import signal
    from datetime import timedelta

    import torch.distributed as dist

    import prismdp.distributed as pd

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: seen.update(
        backend=backend, timeout=timeout, handling=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")))
    monkeypatch.setattr(pd, "current_world", lambda: None)
    monkeypatch.setattr(pd.atexit, "register", lambda fn: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("PRISMDP_DIST_TIMEOUT", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    try:
        pd.init_from_env()
        assert seen == {"backend": "nccl", "timeout": timedelta(seconds=300), "handling": "1"}
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        monkeypatch.setenv("PRISMDP_DIST_TIMEOUT", "45")
        pd.init_from_env()
        assert seen == {"backend": "nccl", "timeout": timedelta(seconds=45), "handling": "3"}
        monkeypatch.setenv("PRISMDP_DIST_TIMEOUT", "soon")
        with pytest.raises(ValueError, match="PRISMDP_DIST_TIMEOUT='soon': give the seconds"):
            pd.init_from_env()
    finally:
        signal.signal(signal.SIGTERM, before)
