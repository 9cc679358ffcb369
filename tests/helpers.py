"""Tiny random-init models and batches shared by the tests (no downloads)."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM


def tiny_bert_cls(num_labels: int = 2, r: int = 4, targets=("query", "value"), dropout: float = 0.0, seed: int = 0):
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
        max_position_embeddings=64, num_labels=num_labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    base = BertForSequenceClassification(cfg).eval()
    lcfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=list(targets), task_type="SEQ_CLS")
    return get_peft_model(base, lcfg)


def tiny_llama(r: int = 4, targets=("q_proj", "v_proj", "up_proj", "down_proj"), seed: int = 0, dropout: float = 0.0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )
    base = LlamaForCausalLM(cfg).eval()
    lcfg = LoraConfig(r=r, lora_alpha=r, lora_dropout=dropout, target_modules=list(targets), task_type="CAUSAL_LM")
    return get_peft_model(base, lcfg)


def padded_batch(lengths, vocab=100, seed=0, pad_id=0):
    """Right-padded random token batch with its attention mask."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), T), dtype=torch.long)
    for i, L in enumerate(lengths):
        ids[i, :L] = torch.randint(1, vocab, (L,), generator=g)
        mask[i, :L] = 1
    return ids, mask


class TinyNet(torch.nn.Module):
    """x (b, T, n) -> mean over T of head(proj3(proj2(act(proj(x))))): three LoRA-able linears (two of the same
    shape, so PRISM batches them as one group) and a dense head."""

    def __init__(self, n=10, m=12, k=3):
        super().__init__()
        self.proj = torch.nn.Linear(n, m)
        self.proj2 = torch.nn.Linear(m, m)
        self.proj3 = torch.nn.Linear(m, m)
        self.head = torch.nn.Linear(m, k)

    def forward(self, x):
        return self.head(self.proj3(torch.tanh(self.proj2(torch.tanh(self.proj(x)))))).mean(1)


def tiny_net(r=2, seed=0, head=True, dtype=torch.float32, dropout=0.0):
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=["proj", "proj2", "proj3"],
                     modules_to_save=["head"] if head else None)
    return get_peft_model(TinyNet().to(dtype), cfg)


def net_batch(b, seed=0, T=5, n=10, k=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, T, n, generator=g, dtype=dtype), torch.randint(0, k, (b,), generator=g)


def per_example(model, sampler, x, y):
    """Per-example gradients of the summed per-example classification losses of one batch."""
    from prismdp.losses import classification_losses

    with sampler.record() as rec:
        classification_losses(model(x), y).sum().backward()
    model.zero_grad(set_to_none=True)
    return sampler.grads(rec)


def gauge_transform(pairs, seed):
    """(A, B) -> (A R, B R^-T) with a random invertible R per pair: Z is unchanged."""
    from prismdp.lora import get_factors, set_factors

    g = torch.Generator().manual_seed(seed)
    for pair in pairs:
        A, B = get_factors(pair, torch.float64)
        r = A.shape[1]
        R = torch.randn(r, r, generator=g, dtype=torch.float64) + 2 * torch.eye(r, dtype=torch.float64)
        set_factors(pair, A @ R, B @ torch.linalg.inv(R).T)


def mechanism(sigma, C, b, seed=None, budget=None):
    """A Gaussian mechanism with noise multiplier ``sigma``, clipping bound ``C``, expected batch ``b``."""
    from prismdp.privacy.clipping import DPConfig
    from prismdp.privacy.mechanism import GaussianMechanism

    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return GaussianMechanism(DPConfig(sigma, C, b), generator=gen, budget=budget)


def train_steps(model, sampler, opt, x, y, steps, private=True):
    """``steps`` optimizer steps on the fixed batch (x, y): per-example gradients into the private optimizer, or the
    batch-mean loss's backward for a non-private one."""
    from prismdp.losses import classification_losses

    for _ in range(steps):
        if private:
            opt.accumulate(per_example(model, sampler, x, y))
        else:
            classification_losses(model(x), y).mean().backward()
        opt.step()
        model.zero_grad(set_to_none=True)


def randomise_lora_B(model, seed=5, scale=0.3):
    """Non-zero lora_B, so that lora_A has a non-zero gradient (PEFT starts from lora_B = 0)."""
    from prismdp.lora import find_lora_pairs

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pair in find_lora_pairs(model):
            w = pair.lora_B.weight
            w.copy_(torch.randn(w.shape, generator=g, dtype=w.dtype) * scale)


def method_setup(method, sigma=0.0, b=4.0, clip=0.5, noise_seed=1, private=True, lr=0.05, seed=1,
                 dtype=torch.float32, budget=None):
    """tiny_net and method's optimizer as make_private builds them (prepare, pair discovery, rank-r start, builder),
    with a seeded Gaussian mechanism (sigma, C = clip, expected batch b) or none (``private=False``).  Methods without
    the rank-r start get a random lora_B first.  Returns (model, pairs, sampler, optimizer)."""
    from prismdp.engine import METHODS
    from prismdp.grad_sample import GradSampler
    from prismdp.lora import find_lora_pairs, move_to_rank_r_start

    model = tiny_net(seed=seed, dtype=dtype)
    spec = METHODS[method]
    if not spec.rank_r_start:
        randomise_lora_B(model)
    if spec.prepare is not None:
        spec.prepare(model, "default")
    pairs = find_lora_pairs(model, trainable=spec.trainable)
    if spec.rank_r_start:
        move_to_rank_r_start(pairs)
    sampler = GradSampler(model, pairs)
    mech = mechanism(sigma, clip, b, noise_seed, budget=budget) if private else None
    return model, pairs, sampler, spec.build(pairs, sampler.dense_params, lr=lr, mechanism=mech)


def interrupt_when_logged(metrics: Path, steps: int, pid: int | None = None, sig=signal.SIGINT):
    """A thread that sends ``sig`` to ``pid`` (this process by default) once ``metrics`` holds ``steps`` records:
    Ctrl-C in the middle of a run."""
    def watch():
        deadline = time.time() + 600
        while time.time() < deadline:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
                os.kill(pid or os.getpid(), sig)
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------- the Poisson sampling law


def poisson_law_p_values(x: torch.Tensor, q: float) -> dict:
    """p-values of the Poisson sampling law on an inclusion matrix x (steps, N): every entry an independent
    Bernoulli(q).  Checked: batch sizes Binomial(N, q) (chi-square goodness of fit), each example's inclusion count
    Binomial(steps, q) (chi-square over examples), independence across examples (pairwise correlations:
    steps * sum r_ij^2 ~ chi2(N (N-1) / 2)) and across steps (each example's lag-1 and lag-2 autocorrelation,
    steps * sum r^2 ~ chi2(2 N))."""
    from scipy import stats

    T, N = x.shape
    out = {}
    sizes = x.sum(1).numpy()
    lo, hi = int(stats.binom.ppf(0.005, N, q)), int(stats.binom.ppf(0.995, N, q))
    edges = [-0.5] + [k + 0.5 for k in range(lo, hi)] + [N + 0.5]
    observed = [((sizes > a) & (sizes < b)).sum() for a, b in zip(edges, edges[1:])]
    cdf = stats.binom.cdf([e for e in edges[1:-1]], N, q)
    expected = T * torch.diff(torch.tensor([0.0, *cdf, 1.0], dtype=torch.float64)).numpy()
    out["batch size ~ Binomial(N, q)"] = stats.chisquare(observed, expected).pvalue
    counts = x.sum(0).numpy()
    z = (counts - T * q) / math.sqrt(T * q * (1 - q))
    out["inclusions per example ~ Binomial(T, q)"] = stats.chi2.sf(float((z ** 2).sum()), N)
    xc = (x - x.mean(0)) / x.std(0, unbiased=False)
    corr = (xc.T @ xc) / T
    pairs = corr[torch.triu(torch.ones(N, N, dtype=torch.bool), diagonal=1)]
    out["independent across examples"] = stats.chi2.sf(float(T * (pairs ** 2).sum()), N * (N - 1) // 2)
    lags = torch.cat([(xc[lag:] * xc[:-lag]).mean(0) for lag in (1, 2)])
    out["independent across steps"] = stats.chi2.sf(float(T * (lags ** 2).sum()), 2 * N)
    return out


def cross_rank_p_values(x0: torch.Tensor, x1: torch.Tensor, q: float, lags=(-2, -1, 0, 1, 2)) -> dict:
    """p-values of independence between two ranks' inclusions: x0 (T, n0) and x1 (T, n1), each rank's own examples
    (columns in the order of the examples it owns, rows the steps). Checked: neighbours on different ranks (column k
    of each) are included together with probability q^2 (their joint count is Binomial(T min(n0, n1), q^2)); every
    cross-rank pair is uncorrelated at the given step lags (T' sum r^2 ~ chi2); and neither rank's stream of
    inclusions is a shifted copy of the other's (the two flattened 0/1 sequences, step-major, cross-correlated at
    every shift leaving at least half of them overlapping: the largest |z| with a Bonferroni correction)."""
    import numpy as np
    from scipy import stats

    T, m = x0.shape[0], min(x0.shape[1], x1.shape[1])
    a, b = x0.double(), x1.double()
    out = {}
    joint = int((a[:, :m] * b[:, :m]).sum())
    lo, hi = stats.binom.cdf(joint, T * m, q * q), stats.binom.sf(joint - 1, T * m, q * q)
    out["neighbours on different ranks: joint inclusion ~ q^2"] = float(min(1.0, 2 * min(lo, hi)))
    za = (a - a.mean(0)) / a.std(0, unbiased=False)
    zb = (b - b.mean(0)) / b.std(0, unbiased=False)
    stat, dof = 0.0, 0
    for lag in lags:
        u, v = (za[lag:], zb[: T - lag]) if lag >= 0 else (za[: T + lag], zb[-lag:])
        r = (u.T @ v) / u.shape[0]
        stat += float(u.shape[0] * (r ** 2).sum())
        dof += r.numel()
    out[f"cross-rank pairs uncorrelated at lags {tuple(lags)}"] = float(stats.chi2.sf(stat, dof))
    sa = (a.flatten() - q) / math.sqrt(q * (1 - q))
    sb = (b.flatten() - q) / math.sqrt(q * (1 - q))
    M = min(len(sa), len(sb))
    sa, sb = sa[:M].numpy(), sb[:M].numpy()
    size = 1 << (2 * M - 1).bit_length()
    cc = np.fft.irfft(np.fft.rfft(sa, size) * np.conj(np.fft.rfft(sb, size)), size)  # cc[s] = sum_i a[i + s] b[i]
    shifts = np.arange(-(M // 2), M // 2 + 1)
    z = np.abs(cc[shifts % size]) / np.sqrt(M - np.abs(shifts))
    out["no rank's stream a shifted copy of another's"] = float(min(1.0, len(shifts) * 2 * stats.norm.sf(z.max())))
    return out


# ---------------------------------------------------------------- processes that cannot outlive their test

TESTS = Path(__file__).resolve().parent
SPAWN_TAG = "PRISMDP_TEST_SPAWN"  # in the environment of every process a test starts, and of their children


def _tagged(tag: str) -> list[int]:
    """Live processes (zombies aside) whose environment carries ``SPAWN_TAG=tag``: the processes a test started and
    every descendant (torchrun starts its workers in sessions of their own, so a process group is not enough)."""
    mark, found = f"{SPAWN_TAG}={tag}".encode(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z" and \
                    mark in (d / "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
        except (OSError, IndexError):
            continue
    return found


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


class Spawned:
    """Commands started for one test, each in a session (process group) of its own, all tagged in their environment.
    :meth:`wait` is bounded: past ``timeout`` every tagged process (the commands, torchrun's workers, their children)
    is killed and the test fails with the tails of their stderr, instead of hanging. Leaving the ``with`` block kills
    whatever is still running and asserts that no tagged process remains."""

    def __init__(self, cmds: list[list[str]], log_dir: Path, env: dict | None = None, names=None):
        import subprocess
        import uuid

        self.tag = uuid.uuid4().hex
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {}), SPAWN_TAG: self.tag,
               "PYTHONPATH": os.pathsep.join(p for p in [str(TESTS), os.environ.get("PYTHONPATH", "")] if p)}
        names = names or [f"proc{i}" for i in range(len(cmds))]
        self.logs = [(log_dir / f"{n}.out", log_dir / f"{n}.err") for n in names]
        self.procs = []
        for cmd, (out, err) in zip(cmds, self.logs):
            with open(out, "w") as o, open(err, "w") as e:
                self.procs.append(subprocess.Popen(cmd, stdout=o, stderr=e, env=env, start_new_session=True))

    def _read(self, i: int) -> Finished:
        out, err = self.logs[i]
        return Finished(self.procs[i].returncode, out.read_text(errors="replace"), err.read_text(errors="replace"))

    def wait(self, timeout: float) -> list[Finished]:
        import subprocess

        deadline = time.monotonic() + timeout
        try:
            for p in self.procs:
                p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            running = len(_tagged(self.tag))
            self.kill()
            tails = "\n".join(f"--- {err.name}:\n{err.read_text(errors='replace')[-1500:]}" for _, err in self.logs)
            raise AssertionError(f"{running} process(es) still running after {timeout:.0f} s (a hang); all killed\n"
                                 f"{tails}") from None
        return [self._read(i) for i in range(len(self.procs))]

    def find(self, entry: str, timeout: float = 120.0) -> int:
        """The pid of a tagged process whose environment holds ``entry`` (e.g. ``RANK=1``: torchrun's rank-1 worker)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid in _tagged(self.tag):
                try:
                    if entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                        return pid
                except OSError:
                    continue
            time.sleep(0.1)
        raise AssertionError(f"no spawned process with {entry} appeared within {timeout:.0f} s")

    def kill(self) -> None:
        """SIGKILL to every tagged process and its process group, until none is left (bounded: 30 s)."""
        deadline = time.monotonic() + 30
        while True:
            pids = _tagged(self.tag) + [p.pid for p in self.procs if p.poll() is None]
            if not pids or time.monotonic() > deadline:
                break
            for pid in set(pids):
                for kill in (lambda: os.killpg(os.getpgid(pid), signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                    try:
                        kill()
                    except (ProcessLookupError, PermissionError):
                        pass
            for p in self.procs:
                if p.poll() is None:
                    try:
                        p.wait(1.0)
                    except Exception:  # noqa: BLE001 (still dying: the next round looks again)
                        pass
            time.sleep(0.05)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
        left = _tagged(self.tag)
        assert not left, f"processes {left} survived their test"


def spawn_workers(fn: str, world: int, tmp_path: Path, *args, timeout: float = 240) -> list[Finished]:
    """``world`` processes running ``tests/dist_workers.<fn>(rank, world, init_file, *args)`` (args: JSON values),
    meeting through a gloo file store; bounded by ``timeout`` (then all are killed and the test fails)."""
    import json
    import sys

    init = Path(tmp_path) / "init"
    code = "import sys, dist_workers; dist_workers.main(sys.argv[1:])"
    cmds = [[sys.executable, "-c", code, fn, str(r), str(world), str(init), json.dumps(list(args))]
            for r in range(world)]
    with Spawned(cmds, Path(tmp_path) / "logs", names=[f"{fn}{r}" for r in range(world)]) as group:
        return group.wait(timeout)


class ExitCodes(list):
    """Exit codes of spawned workers; their repr (what a failed ``assert codes == [...]`` prints) adds the stderr tail
    of each worker that did not exit 0, so a crash (e.g. -6) says where it happened."""

    def __init__(self, runs: list[Finished]):
        super().__init__(r.returncode for r in runs)
        self.tails = [f"--- rank {i} exited {r.returncode}, stderr ends:\n{r.stderr[-1500:]}"
                      for i, r in enumerate(runs) if r.returncode != 0]

    def __repr__(self):
        return "\n".join([list.__repr__(self), *self.tails])


NATIVE_CRASHES = {-6: "SIGABRT", -7: "SIGBUS", -11: "SIGSEGV"}


def worker_codes(fn, world: int, tmp_path: Path, *args, timeout: float = 240,
                 native_crash_retries: int = 0) -> ExitCodes:
    """Exit codes of ``world`` processes running ``dist_workers.<fn>`` (a function of it, or its name) through
    :func:`spawn_workers` (bounded: a hang kills them all and fails); printed, they show the failed workers' stderr.
    ``native_crash_retries``: where a worker died of a native crash (:data:`NATIVE_CRASHES`), run the workers again
    (in a fresh folder for the store and logs; their outputs overwritten), up to this many times, with a warning
    naming the crash.  Only for the sharded-NF4 tests, whose gloo workers abort now and then with glibc's heap
    corruption check (``malloc(): unaligned tcache chunk detected``; cause open, see tests/test_fsdp.py): a wrong
    result, a Python error or a hang is never retried."""
    import warnings

    name = getattr(fn, "__name__", fn)
    for attempt in range(native_crash_retries + 1):
        folder = Path(tmp_path) / f"retry{attempt}" if attempt else Path(tmp_path)
        folder.mkdir(parents=True, exist_ok=True)
        codes = ExitCodes(spawn_workers(name, world, folder, *args, timeout=timeout))
        crashes = [NATIVE_CRASHES[c] for c in codes if c in NATIVE_CRASHES]
        if not crashes or attempt == native_crash_retries:
            return codes
        warnings.warn(f"{name}: a worker died of {crashes[0]} (a native crash), run again:\n{codes!r}")
    return codes


def torchrun_cmd(nproc: int, *argv: str) -> list[str]:
    """``python -m torch.distributed.run --nproc-per-node nproc`` with a free rendezvous port, then ``argv`` (a script
    and its arguments, or ``-m module ...``)."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr", "127.0.0.1",
            "--master-port", str(port), *argv]


def torchrun(nproc: int, argv: list[str], tmp_path: Path, timeout: float = 240, env: dict | None = None,
             name: str = "torchrun") -> Finished:
    """One torchrun command, bounded by ``timeout`` (then torchrun and its workers are killed and the test fails)."""
    with Spawned([torchrun_cmd(nproc, *argv)], Path(tmp_path) / "logs", env=env, names=[name]) as group:
        return group.wait(timeout)[0]


def run_python(code: str, timeout: float, env: dict | None = None) -> Finished:
    """``python -c code`` (``env`` added to the environment), bounded by ``timeout`` (then it and any child are killed
    and the test fails)."""
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as logs, Spawned([[sys.executable, "-c", code]], Path(logs), env) as group:
        return group.wait(timeout)[0]
