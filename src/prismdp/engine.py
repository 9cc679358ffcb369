"""``make_private``: one call that turns a PEFT LoRA model into a private training setup (like Opacus'
``PrivacyEngine.make_private``), for plain PyTorch training loops.

    private = make_private(model, method="prism", lr=2e-4, dataset_size=N, batch_size=64, steps=T,
                           target_epsilon=3.0, delta=1e-5, max_grad_norm=1.0, seed=0)
    for batch in private.batches():                      # Poisson batches of indices
        for micro in split_micro_batches(batch, 8):
            private.backward(per_example_losses(model, micro))   # (b,) losses, one per example
        private.step()                                   # clip, noise, update; refuses to exceed the budget
    print(private.epsilon)

``step()`` reads its statistics to the host; a loop that must not wait for the device queues the step with
``report = private.queue_step(totals)`` and reads everything the step reports later, at once (``report.read()``).
"""

from __future__ import annotations

import contextlib
import secrets

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from .base import describe_base
from .distributed import World, current_world, shard_seed
from .grad_sample import PRODUCTS, GradSampler, float32_trainables
from .lora import LoraPair, RankRStart, find_lora_pairs, freeze_lora_A, move_to_rank_r_start
from .quiet import install as install_quiet
from .optim import PRISM, dp_adamw, dp_ffa, dp_lamb, dp_lora_plus, dp_lora_rite
from .privacy import BudgetExhaustedError, PoissonSampler, PrivacyBudget, calibrate_sigma, check_delta, epsilon
from .processes import REPLICA_CHECK_EVERY, OneProcess, micro_step_protocol
from .privacy.accounting import vacuous_delta_error
from .privacy.clipping import ClipStats, DPConfig, noise_generator
from .privacy.mechanism import GaussianMechanism
from .privacy.secure import SEEDED_NOISE, SecureRandom, TorchNoise

install_quiet()  # library messages known to be harmless (prismdp.quiet), for the Python API as for the CLI

__all__ = ["make_private", "PrivateLoRA", "StepReport", "METHODS", "MethodSpec", "register_method", "set_dense_lr",
           "to_device", "REPLICA_CHECK_EVERY"]

@dataclass
class MethodSpec:
    """Everything prismdp knows about one training method, registered once (:func:`register_method`).

    How to build it: its optimizer (``build``), whether it starts on the rank-r manifold, how it prepares the model
    before the LoRA pairs are discovered (``prepare(model, adapter)``, e.g. freezing ``lora_A``) and which factors it
    trains (``find_lora_pairs(..., trainable=...)``).  How to show and run it: its display ``label`` (the tables and
    figures) and its default learning rate per task family (``lr``: ``{"glue": ..., "math": ..., "demo": ...}``, the
    families of :data:`prismdp.data.tasks.TASKS`; a family without one needs an explicit rate).
    """

    build: Callable[..., object]
    rank_r_start: bool
    prepare: Callable[[nn.Module, str], None] | None = None
    trainable: str = "both"
    label: str = ""
    lr: dict[str, float] = field(default_factory=dict)


METHODS: dict[str, MethodSpec] = {}


def register_method(name: str, build: Callable[..., object], rank_r_start: bool = False, *,
                    prepare: Callable[[nn.Module, str], None] | None = None, trainable: str = "both",
                    label: str | None = None, lr: dict[str, float] | None = None) -> MethodSpec:
    """Make ``name`` a method of ``make_private``, ``prismdp train``, ``prismdp experiment``, the Trainer and the
    benchmarks: ``build(pairs, dense_params, lr=..., mechanism=..., **kwargs)`` -> optimizer (``mechanism=None``:
    non-private); ``label`` (default ``name``) and ``lr`` (default learning rate per task family) as in
    :class:`MethodSpec`."""
    if name in METHODS:
        raise ValueError(f"method {name!r} is already registered")
    if any(not v > 0 for v in (lr or {}).values()):
        raise ValueError(f"default learning rates must be positive, got {lr}")
    METHODS[name] = spec = MethodSpec(build, rank_r_start, prepare, trainable, label or name, dict(lr or {}))
    return spec


def _build_prism(pairs, dense_params, *, lr, mechanism, **kw):
    return PRISM(pairs, lr=lr, dense_params=dense_params, mechanism=mechanism, **kw)


def _build_dp_adamw(pairs, dense_params, *, lr, mechanism, **kw):
    return dp_adamw(pairs, dense_params, lr=lr, mechanism=mechanism, **kw)


# Labels: the paper's Table 2 spelling.  Learning rates: the paper's per task family (Appendix B, "Method-specific
# hyperparameters"), and for the built-in demo task (100 steps at epsilon 3) PRISM's from two hand-run trials (1e-2
# with the demo defaults reached 0.70 test accuracy; 5e-3 with batch 64, rank 8 and 2,000 examples stayed at chance);
# the other methods' demo rates are untuned typical Adam/LAMB rates.
_ADAM_LIKE = {"glue": 2e-4, "math": 3e-4, "demo": 2e-3}
register_method("prism", _build_prism, rank_r_start=True, label="PRISM", lr={**_ADAM_LIKE, "demo": 1e-2})
register_method("dp-adamw", _build_dp_adamw, label="AdamW", lr=_ADAM_LIKE)
register_method("ffa", dp_ffa, prepare=freeze_lora_A, trainable="B", label="FFA", lr=_ADAM_LIKE)
register_method("lora-plus", dp_lora_plus, label="LoRA+", lr=_ADAM_LIKE)
register_method("lamb", dp_lamb, label="LAMB", lr={"glue": 5e-3, "math": 5e-3, "demo": 5e-3})
register_method("lora-rite", dp_lora_rite, label="RITE", lr=_ADAM_LIKE)


def to_device(t: Tensor, device: torch.device | str | None) -> Tensor:
    """``t`` on ``device`` without stalling the host: a CPU tensor bound for CUDA is pinned and copied
    asynchronously (a plain ``.to("cuda")`` from pageable memory waits for the device's queue to drain); elsewhere
    a plain ``.to``.  ``device=None`` leaves ``t`` where it is."""
    if device is None:
        return t
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _unit_counts(groups, b: int) -> tuple[Tensor, Tensor]:
    """``groups`` (the unit of each of ``b`` examples, numbered 0..g-1) as a long tensor, and each unit's example
    count; refuses gaps.  A list is checked on the host (no device read per micro-batch); a tensor where it lives."""
    if not torch.is_tensor(groups):
        groups = [int(u) for u in groups]
        if len(groups) != b or set(groups) != set(range(max(groups, default=-1) + 1)):
            raise ValueError("groups must give each example its unit, numbered 0..g-1 without gaps")
        groups = torch.tensor(groups, dtype=torch.long)
        return groups, torch.bincount(groups)
    groups = groups.long()
    counts = torch.bincount(groups)
    if groups.shape != (b,) or bool((counts == 0).any()):
        raise ValueError("groups must give each example its unit, numbered 0..g-1 without gaps")
    return groups, counts


def set_dense_lr(optimizer, dense_params: list[nn.Parameter], lr: float) -> None:
    """Give the dense (non-LoRA) parameters their own learning rate: they move to a param group of their own (other
    hyper-parameters copied from the group they leave).  Call before the first step."""
    if not lr > 0:
        raise ValueError(f"dense_lr must be > 0, got {lr}")
    inner = getattr(optimizer, "optimizer", optimizer)  # DPFactorOptimizer wraps a torch optimizer
    dense = {id(p) for p in dense_params}
    for group in list(inner.param_groups):
        moved = [p for p in group["params"] if id(p) in dense]
        if not moved:
            continue
        if len(moved) == len(group["params"]):
            group["lr"] = lr
            continue
        group["params"] = [p for p in group["params"] if id(p) not in dense]
        inner.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": moved, "lr": lr})


@dataclass(frozen=True)
class StepReport:
    """What one queued logical step reports, held where it was computed until :meth:`read`, the step's one read to
    the host (on a GPU its one wait for the device; call it after the step is queued).

    ``clip``: a private step's clipping statistics (device tensors, summed over processes); ``host``: numbers already
    on the host (a non-private step's batch size; a registered optimizer's ``last_stats`` where it keeps no
    ``last_clip``); ``totals``: ``[summed per-example loss, number of examples]`` (float64, from
    :func:`prismdp.train.step.backward_micro_batches`), or None; ``flags``: more one-element tensors read with the
    rest, each under its name (the training loop's stop agreement across processes)."""

    clip: ClipStats | None = None
    host: dict = field(default_factory=dict)
    totals: Tensor | None = None
    flags: dict[str, Tensor] = field(default_factory=dict)

    def read(self) -> dict[str, float]:
        """The step's numbers, in one ``.tolist()`` of one stacked tensor: :meth:`ClipStats.summary`'s keys (a
        private step) or ``batch_size`` (a non-private one), and with ``totals`` the mean per-example ``loss`` (None
        for an empty batch) and its number of ``examples`` (int)."""
        parts = ([] if self.totals is None else [self.totals.reshape(2).double()]) \
            + ([] if self.clip is None else [self.clip.stacked()]) \
            + [t.reshape(1).double() for t in self.flags.values()]
        values = torch.cat([t.to(parts[0].device) for t in parts]).tolist() if parts else []
        out = dict(self.host)
        if self.flags:
            values, flags = values[:-len(self.flags)], values[-len(self.flags):]
            out.update(zip(self.flags, flags))
        if self.totals is not None:
            (loss_sum, n), values = values[:2], values[2:]
            out.update(loss=loss_sum / n if n else None, examples=int(n))
        if self.clip is not None:
            out.update(ClipStats.summary(values))
        return out


@dataclass
class PrivateLoRA:
    """Everything one private (or non-private) LoRA training run needs, explicit and inspectable."""

    model: nn.Module
    method: str
    pairs: list[LoraPair]
    grad_sampler: GradSampler
    optimizer: object
    mechanism: GaussianMechanism | None  # clipping, noise and budget; None for a non-private run
    data_sampler: PoissonSampler
    start: RankRStart | None
    delta: float
    accountant: str
    world: World | None = None  # the process group of a multi-process run (prismdp.distributed)
    lockstep: bool = False  # forward passes are collectives (a sharded base, prismdp.base): see prismdp.processes
    _seen: int = field(default=0, repr=False)
    processes: OneProcess = field(init=False, repr=False)  # how the micro-steps run across the processes

    def __post_init__(self):
        self.processes = micro_step_protocol(self.world, self.lockstep)  # chosen once, here
        # the parameters that can hold a gradient, listed once: model.zero_grad() walks every module of the model at
        # each call (its host cost: docs/performance.md, "Design choices measured")
        self._trained = [p for p in self.model.parameters() if p.requires_grad]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``model.zero_grad`` over the parameters that required a gradient when this object was made (the others
        never hold one; a parameter unfrozen later is not cleared here)."""
        for p in self._trained:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().zero_()

    @property
    def private(self) -> bool:
        return self.mechanism is not None

    @property
    def dp(self) -> DPConfig | None:
        return self.mechanism.dp if self.mechanism is not None else None

    @property
    def budget(self) -> PrivacyBudget | None:
        return self.mechanism.budget if self.mechanism is not None else None

    def batches(self) -> Iterator[Tensor]:
        """The remaining Poisson batches (index tensors), resumable through :meth:`state_dict`."""
        return iter(self.data_sampler)

    def backward(self, losses: Tensor, groups: Tensor | Sequence[int] | None = None) -> None:
        """Backpropagate one micro-batch of per-example losses (shape (b,); each depends on its example only).

        ``groups`` (b,) (user-level privacy): the privacy unit of each example, numbered ``0..g-1`` within the
        micro-batch, every unit's examples all in this micro-batch.  Each unit then contributes the *mean* of its
        examples' gradients, clipped to C as one contribution: a unit's influence is bounded by C however many
        examples it owns, and a unit with 50 examples weighs as much in the estimate as a unit with one."""
        if losses.dim() != 1:
            raise ValueError(
                f"backward() takes per-example losses of shape (batch,), got {tuple(losses.shape)}; use "
                "prismdp.losses.* with no reduction over the batch"
            )
        if losses.numel() == 0:
            return
        n_units = losses.numel()
        if groups is not None:
            groups, counts = _unit_counts(groups, losses.numel())
            n_units = counts.numel()
            losses = losses / to_device(counts[groups], losses.device)
            groups = to_device(groups, losses.device)
        losses.sum().backward()
        if self.private:
            grads = self.grad_sampler.collect()
            self.optimizer.accumulate(grads if groups is None else grads.sum_by(groups, n_units))
            self.zero_grad()
        else:
            self._seen += n_units

    def step(self) -> dict[str, float]:
        """One optimizer step for the logical batch; returns its statistics (clip fraction, batch size, ...), read to
        the host (:meth:`queue_step` leaves them on the device)."""
        return self.queue_step().read()

    def queue_step(self, totals: Tensor | None = None) -> StepReport:
        """One optimizer step for the logical batch, queued without waiting for the device; returns its
        :class:`StepReport` (with the loss ``totals`` of :func:`~prismdp.train.step.backward_micro_batches` if
        given), read later in one host read."""
        host: dict = {}
        if not self.private:  # the mean over every rank's examples
            seen = self.processes.sum_gradients(self._trained, self._seen)
            if seen:
                for p in self._trained:
                    if p.grad is not None:
                        p.grad.div_(seen)
            host = {"batch_size": float(seen)}
            self._seen = 0
        self.optimizer.step()
        self.zero_grad()
        clip = getattr(self.optimizer, "last_clip", None) if self.private else None
        if self.private and clip is None:  # a registered optimizer without device statistics: its own read
            host = dict(self.optimizer.last_stats)
        return StepReport(clip, host, totals)

    def run_micro_steps(self, micros: Sequence[tuple[list[int], list[int] | None]],
                        micro_step: Callable[[list[int], list[int] | None], None],
                        stand_in: Callable[[], Tensor]) -> None:
        """Run one logical step's micro-batches as this run's processes need (:mod:`prismdp.processes`):
        ``micro_step(indices, groups)`` for each micro-batch with examples; where the ranks run in lockstep (a
        sharded base) a rank with fewer micro-batches also runs idle ones, ``stand_in()`` (losses of a stand-in
        forward) under :meth:`idle`, their gradient discarded."""
        def idle_step() -> None:
            with self.idle():
                stand_in().sum().mul(0.0).backward()

        self.processes.run(micros, micro_step, idle_step)

    def after_step(self, step: int, checkpoint: bool = False) -> None:
        """The multi-process checks after logical step ``step``: every rank must hold the same trained tensors
        (compared every :data:`~prismdp.processes.REPLICA_CHECK_EVERY` steps and at a ``checkpoint``; no-op in one
        process)."""
        self.processes.check_replicas(self._trained, step, force=checkpoint)

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """An idle micro-step of a sharded base (``lockstep``): a rank with fewer micro-batches than another still
        runs each forward and backward, because FSDP gathers every block's weights from all ranks.  Inside, the taps
        record nothing and the gradient computed is discarded on exit: the step's release is not touched."""
        armed = self.grad_sampler.armed
        self.grad_sampler.disarm()
        try:
            yield
        finally:
            self.zero_grad()
            if armed:
                self.grad_sampler.arm()

    def check_replicas(self, step: int) -> None:
        """Multi-process runs: fail loudly unless every rank holds the same trained tensors (no-op in one process)."""
        self.processes.check_replicas(self._trained, step, force=True)

    @property
    def epsilon(self) -> float:
        return self.budget.epsilon if self.budget is not None else float("inf")

    def privacy_report(self) -> dict:
        if self.budget is None:
            return {"private": False}
        rep = self.budget.report()
        rep.update(private=True, max_grad_norm=self.dp.max_grad_norm, method=self.method,
                   expected_batch_size=self.dp.expected_batch_size,
                   world_size=1 if self.world is None else self.world.size,
                   secure_noise=isinstance(self.mechanism.noise_source, SecureRandom)
                   and isinstance(self.data_sampler.generator, SecureRandom),
                   noise_source=self.mechanism.noise_source.describe(), sampling_source=self.data_sampler.describe())
        return rep

    # ------------------------------------------------------------------ checkpoints

    def _rank_state(self) -> dict:
        return {"data_sampler": self.data_sampler.state_dict(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}

    def state_dict(self) -> dict:
        """Everything a resume needs, between two logical steps: the trained tensors, the optimizer state, the
        mechanism (noise generator, budget), the rank-r start, and per process the data sampler and the RNG states
        (dropout).  In a multi-process run every rank must call it (it gathers the per-rank parts)."""
        ranks = [self._rank_state()] if self.world is None else self.world.gather_objects(self._rank_state(),
                                                                                             "checkpoint state")
        return {
            "method": self.method,
            "world_size": 1 if self.world is None else self.world.size,
            "trainable": {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad},
            "optimizer": self.optimizer.state_dict(),
            "mechanism": self.mechanism.state_dict() if self.mechanism is not None else None,
            "start": self.start.state_dict() if self.start is not None else None,
            "ranks": ranks,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` of the same run (same model, method and privacy settings)."""
        if state.get("method") != self.method:
            raise ValueError(f"the checkpoint was trained with method {state.get('method')!r}, not {self.method!r}")
        size = 1 if self.world is None else self.world.size
        if state.get("world_size", 1) != size:
            raise ValueError(f"the checkpoint was written by a run of {state.get('world_size', 1)} process(es); resume "
                             f"it with the same number (this run has {size})")
        if (state.get("mechanism") is None) != (self.mechanism is None):
            raise ValueError("the checkpoint's run was " + ("non-private" if state.get("mechanism") is None else
                                                             "private") + ", this one is not")
        if self.start is not None:
            saved = RankRStart.from_state_dict(state["start"])
            for (a, b), (a2, b2) in zip(self.start.factors, saved.factors, strict=True):
                # a checkpoint is read onto the CPU; the recomputed start lives on the model's device (CUDA)
                a2, b2 = a2.to(a.device), b2.to(b.device)
                if not (torch.allclose(a, a2, atol=1e-6) and torch.allclose(b, b2, atol=1e-6)):
                    raise ValueError("the rank-r start recomputed on resume differs from the checkpoint's; was the "
                                     "base model changed? Resume with the same model.")
        params = dict(self.model.named_parameters())
        missing = sorted(set(state["trainable"]) - set(params))
        if missing:
            raise ValueError(f"the checkpoint holds parameters this model does not have: {missing[:5]}")
        with torch.no_grad():
            for name, value in state["trainable"].items():
                params[name].copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.mechanism is not None:
            self.mechanism.load_state_dict(state["mechanism"])
        mine = state["ranks"][0 if self.world is None else self.world.rank]
        self.data_sampler.load_state_dict(mine["data_sampler"])
        torch.set_rng_state(mine["torch_rng"])
        if mine.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(mine["cuda_rng"])
        self._seen = 0


def make_private(
    model: nn.Module,
    *,
    method: str = "prism",
    lr: float,
    dataset_size: int,
    batch_size: float,
    steps: int,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    delta: float = 1e-5,
    max_grad_norm: float = 1.0,
    accountant: str = "prv",
    seed: int | None = None,
    init: str = "spectral",
    rank_r_start: bool | None = None,
    adapter: str = "default",
    dense_lr: float | None = None,
    start: RankRStart | None = None,
    world: World | None = None,
    secure_noise: bool = False,
    noise_threads: int | None = None,
    allow_large_delta: bool = False,
    products: str = "float32",
    **method_kwargs,
) -> PrivateLoRA:
    """Validate the model, calibrate sigma for exactly ``steps`` Poisson steps and build the optimizer.

    ``batch_size`` is the *expected* logical batch size (sample rate ``q = batch_size / dataset_size``).  Give
    ``target_epsilon`` (sigma is calibrated) or ``noise_multiplier`` (epsilon is tracked and capped at nothing);
    neither gives a non-private run with the same geometry.  ``dense_lr`` sets the learning rate of the trainable
    non-LoRA parameters (e.g. a new classification head; default ``lr``).  ``start``: the pairs were already moved
    to this rank-r start (:func:`~prismdp.lora.move_to_rank_r_start`, e.g. to change their gauge first); it is kept
    for the export instead of moving them again.  ``rank_r_start``: start from the rank-r point (``init``) whatever
    the method (``None``: the method's own start; PRISM needs the rank-r start).  A ``seed`` also seeds torch's global generator (dropout masks; one
    stream per rank), so a front end's earlier random draws do not change the run.  ``world``: the process group of a multi-process run (default:
    the initialised default group, if it has more than one process; see :mod:`prismdp.distributed`): each process
    calls ``make_private`` with the same arguments on its copy of the model.  ``secure_noise``: Gaussian noise and
    Poisson inclusions from OS-keyed ChaCha20, noise as Holohan-Braghin sums of normals (:mod:`prismdp.privacy.secure`);
    it takes no ``seed`` (a seeded stream is predictable); ``noise_threads``: the CPU threads drawing its noise (default
    ``torch.get_num_threads()``, which torchrun sets to 1).  ``products``: the precision of the per-example gradient
    products (:data:`~prismdp.grad_sample.PRODUCTS`: float32, or TF32 / bf16 inputs with float32 accumulation, for
    speed on a GPU; the guarantee is the same, since each example's computed gradient is clipped whatever its
    rounding).  Every check runs before any noise is drawn.  A ``delta``
    at or above ``1 / dataset_size`` is refused (the guarantee would not rule out leaking a whole example) unless
    ``allow_large_delta``.
    """
    install_quiet()
    spec, rank_r_start = _check_arguments(method, dataset_size, batch_size, steps, target_epsilon, noise_multiplier,
                                          seed, secure_noise, noise_threads, rank_r_start, products)
    pairs, grad_sampler = _wire_model(model, spec, adapter)
    grad_sampler.products = products
    dp, budget = _calibrate(target_epsilon, noise_multiplier, delta, max_grad_norm, batch_size, dataset_size, steps,
                            accountant, allow_large_delta)
    world = world if world is not None else current_world()
    frozen = describe_base(model, world)  # its layouts kept (evaluations compute what training does); lockstep
    streams = _Streams.make(seed, world, secure_noise, noise_threads, pairs[0].lora_A.weight.device, dp is not None)
    mechanism = None
    if dp is not None:
        mechanism = GaussianMechanism(dp, generator=streams.noise, budget=budget, device=streams.device,
                                      reduce=world.all_reduce_sum if world is not None else None)
    if start is None and rank_r_start:
        start = move_to_rank_r_start(pairs, init=init, generator=torch.Generator().manual_seed(streams.seed + 2))
    optimizer = _build_optimizer(spec, pairs, grad_sampler, lr, mechanism, dense_lr, method_kwargs)
    data_sampler = PoissonSampler(dataset_size, batch_size / dataset_size, steps, generator=streams.data,
                                  shard=(world.rank, world.size) if world is not None else (0, 1))
    if seed is not None or world is not None:
        streams.seed_dropout(world)
    return PrivateLoRA(model, method, pairs, grad_sampler, optimizer, mechanism, data_sampler, start, delta,
                       accountant, world, lockstep=frozen.lockstep)


def _check_arguments(method, dataset_size, batch_size, steps, target_epsilon, noise_multiplier, seed, secure_noise,
                     noise_threads, rank_r_start, products) -> tuple[MethodSpec, bool]:
    """``make_private``'s arguments checked (before anything is changed or drawn); returns the method's spec and
    whether the run starts from the rank-r point."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {sorted(METHODS)}")
    if not (isinstance(dataset_size, int) and dataset_size > 0):
        raise ValueError(f"dataset_size must be a positive integer, got {dataset_size!r}")
    if not (0 < batch_size <= dataset_size):
        raise ValueError(f"batch_size must be in (0, dataset_size={dataset_size}], got {batch_size}")
    if not (isinstance(steps, int) and steps > 0):
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if target_epsilon is not None and noise_multiplier is not None:
        raise ValueError("give target_epsilon or noise_multiplier, not both")
    if secure_noise and seed is not None:
        raise ValueError("secure_noise draws noise and Poisson samples from an OS-keyed ChaCha20 stream and takes no "
                         f"seed (got seed={seed!r}; a seeded stream is predictable): pass seed=None")
    if noise_threads is not None and not secure_noise:
        raise ValueError("noise_threads sets the threads of secure_noise's ChaCha20 noise (torch's own generator "
                         "draws on its device): pass secure_noise=True or leave noise_threads out")
    if products not in PRODUCTS:
        raise ValueError(f"products={products!r}: the per-example gradient products are computed in one of "
                         f"{', '.join(PRODUCTS)} (inputs; float32 accumulation)")
    spec = METHODS[method]
    if rank_r_start is None:
        rank_r_start = spec.rank_r_start
    elif spec.rank_r_start and not rank_r_start:
        raise ValueError(f"method {method!r} trains on the rank-r manifold and needs the rank-r start "
                         "(rank_r_start=False is not possible)")
    return spec, rank_r_start


def _wire_model(model: nn.Module, spec: MethodSpec, adapter: str) -> tuple[list[LoraPair], GradSampler]:
    """The method's preparation (e.g. ``lora_A`` frozen), the LoRA pairs it trains, the trained tensors in float32
    and the taps of the per-example gradients (refusing trainable parameters they cannot cover)."""
    if spec.prepare is not None:
        spec.prepare(model, adapter)
    pairs = find_lora_pairs(model, adapter, trainable=spec.trainable)
    float32_trainables(model, pairs)  # a bf16/fp16 base model: the trained tensors stay float32
    return pairs, GradSampler(model, pairs)


def _calibrate(target_epsilon, noise_multiplier, delta, max_grad_norm, batch_size, dataset_size, steps, accountant,
               allow_large_delta) -> tuple[DPConfig | None, PrivacyBudget | None]:
    """The mechanism's settings and budget (sigma calibrated for exactly ``steps`` Poisson steps where
    ``target_epsilon`` is given); (None, None) for a non-private run.  The whole run must fit in the budget."""
    if target_epsilon is None and noise_multiplier is None:
        return None, None
    q = batch_size / dataset_size
    check_delta(delta, dataset_size, allow_large=allow_large_delta)
    try:
        if target_epsilon is not None:
            noise_multiplier = calibrate_sigma(target_epsilon, delta, q, steps, accountant=accountant)
        dp = DPConfig(float(noise_multiplier), float(max_grad_norm), float(batch_size))
        budget = PrivacyBudget(dp.noise_multiplier, q, delta, target_epsilon=target_epsilon, accountant=accountant)
        budget.check_step(steps)  # the whole run fits in the budget, or fail now
        spent = epsilon(dp.noise_multiplier, q, steps, delta, accountant) if allow_large_delta else 0.0
        if spent < 0:  # only a large delta can make it negative
            raise vacuous_delta_error(delta, accountant, f"epsilon {spent:.3g} after {steps} steps")
    except BudgetExhaustedError:
        raise
    except RuntimeError as e:  # Opacus' PRV: "Cannot compute epsilon" where delta exceeds what epsilon 0 gives
        raise vacuous_delta_error(delta, accountant, str(e)) from e
    return dp, budget


def _build_optimizer(spec: MethodSpec, pairs, grad_sampler: GradSampler, lr, mechanism, dense_lr, method_kwargs):
    """The method's optimizer on the pairs and the dense trainables (their own rate ``dense_lr``); the taps armed
    where the run is private (per-example gradients are recorded from then on)."""
    optimizer = spec.build(pairs, grad_sampler.dense_params, lr=lr, mechanism=mechanism, **method_kwargs)
    if dense_lr is not None and grad_sampler.dense_params:
        set_dense_lr(optimizer, grad_sampler.dense_params, dense_lr)
    if mechanism is not None:
        grad_sampler.arm()
    return optimizer


@dataclass
class _Streams:
    """The random streams of a run, from one root ``seed``: the noise (one stream shared by every rank: rank 0's
    seed, or with ``secure_noise`` rank 0's ChaCha20 key, broadcast), the Poisson sampling (one stream per rank), the
    random rank-r start (``seed + 2``) and the dropout masks (:meth:`seed_dropout`)."""

    seed: int
    data: object  # torch.Generator or SecureRandom
    noise: object | None  # the mechanism's generator; None for a non-private run
    device: torch.device

    @classmethod
    def make(cls, seed, world, secure_noise, noise_threads, device, private: bool) -> _Streams:
        if world is not None:  # one shared noise stream (rank 0's seed), one sampling stream per rank
            root = world.shared_seed(seed)
            data = torch.Generator().manual_seed(shard_seed(root + 1, world.rank))
        else:
            root = seed if seed is not None else secrets.randbits(62)  # no seed: fresh OS entropy
            data = torch.Generator().manual_seed(root + 1)
        noise = None
        if secure_noise:  # one shared noise key (rank 0's, broadcast), one sampling key per rank
            data = SecureRandom()
        if private:
            if secure_noise:
                noise = SecureRandom(world.shared_key() if world is not None else None, threads=noise_threads)
            else:  # the parameters' device draws the noise, with its own generator (Philox on CUDA)
                noise = TorchNoise(noise_generator(device, seed=root),
                                   SEEDED_NOISE if seed is not None else "OS entropy (secrets.randbits)")
        return cls(root, data, noise, device)

    def seed_dropout(self, world) -> None:
        """Seed torch's global generator with this rank's own stream: dropout (``nn.Dropout``) takes no generator and
        draws its masks from the global one, so a seeded (or multi-process) run seeds it here, where the run's seed
        becomes its streams, and last, so that a front end's earlier draws and the random start do not move the
        masks; each rank gets its own stream (its examples get independent masks)."""
        torch.manual_seed(shard_seed(self.seed + 2, world.rank if world is not None else 0))
