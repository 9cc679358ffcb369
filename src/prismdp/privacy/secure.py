"""Secure noise (``--secure-noise``): Gaussian noise and Poisson inclusion from a cryptographically secure generator.

By default prismdp draws noise and Poisson samples from torch's Mersenne Twister, seeded (from the run's seed or from
the OS).  MT19937 is not a cryptographic generator: its state can be recovered from 624 outputs, and a seeded run's
noise is reproducible by anyone who knows the seed.  In secure mode:

* **Generator**: ChaCha20 (randomgen's ``ChaCha``, 20 rounds) with a 256-bit key from the operating system
  (:func:`secrets.token_bytes`), driving numpy's ``Generator``.  ChaCha20 is a standard stream cipher (RFC 8439),
  vectorised in randomgen and portable (no AES-NI needed, unlike ``AESCounter``), and numpy's samplers run on it
  unchanged.  OpenDP's samplers are exact but draw one scalar per call through Python, far too slow for millions of
  noise coordinates per step.  No seed is accepted: :class:`SecureRandom` refuses one.
* **Floating-point defence**: each noise coordinate is ``(N1 + N2 + N3 + N4) / 2`` of four float64 standard normals
  (Holohan and Braghin 2021, "Secure Random Sampling in Differential Privacy"; what Opacus' ``secure_mode`` does):
  the sum has exactly the N(0, 1) law, so the accountant is unchanged, while the set of reachable values and the
  per-value probabilities no longer carry the lattice artefacts of one float sampler that the attacks of Mironov
  (2012, Laplace) and Jin et al. (2022, Gaussian samplers incl. Opacus') exploit.  A discrete Gaussian on a fine grid
  (Canonne, Kamath, Steinke 2020) would be exact but needs its own accounting (its L2 sensitivity after rounding the
  clipped sum to the grid) and an exact sampler per coordinate; the sum of normals keeps PRV/RDP/PLD valid as they
  are, costs four normal draws per coordinate, and is the defence the reference DP library ships.
* **Precision**: the draws are float64 and are cast to the release's dtype, which is never below float32 (the
  mechanism refuses lower).
* **Checkpoints and resume**: the key is never written to a checkpoint (anyone holding it could recompute every noise
  draw and subtract it from the released updates).  A resumed secure run therefore continues with a *fresh* key from
  the OS: its later steps draw independent noise and samples, which is all the guarantee needs (each step's noise
  must be independent of everything else), but the run is not bit-for-bit the one an uninterrupted run would have
  been (no secure run is reproducible anyway).
* **On a GPU**: ChaCha20 and the four normals per coordinate run on the CPU (randomgen has no GPU kernel); each
  noise tensor is summed and cast to the release's dtype on the CPU into page-locked memory and copied to the device
  once, asynchronously (the step does not wait for it).  Costs per step: ``bench/results/secure-noise/``.
* **Threads**: a noise tensor is drawn in blocks of :data:`BLOCK` coordinates, block j of the c-th draw from its own
  ChaCha20 position (counter ``c * 2^64 + j * 2^40``, the same key: disjoint pieces of one keystream), on up to
  ``torch.get_num_threads()`` threads (numpy's samplers release the GIL).  The values depend on the key, c and j
  only, never on the number of threads: ranks sharing a key draw the same noise whatever their thread settings.
* **Off the critical path** (``background=True``, the default): each release draws its noise tensors in one call
  (:meth:`SecureRandom.normals`), which then starts the next release's draws (the same shapes, the next draw numbers)
  on a background thread while the step runs: ChaCha20, the sums and the cast (into page-locked memory on a GPU).
  The next release takes them if it asks for the same shapes, otherwise they are dropped and drawn again in the
  foreground under the same draw numbers.  The values depend on the key and the draw and block numbers alone, never
  on timing: the background draw equals the foreground one bit for bit, and the draw counter after a release is
  the foreground's (a prefetched draw is not counted until it is taken).
* **Several processes** (:mod:`prismdp.distributed`): the noise of the global sum must be one draw shared by all
  ranks.  Rank 0 draws the key and broadcasts it once (:meth:`prismdp.distributed.World.shared_key`); every rank then
  draws the same noise locally, with no per-step communication.  That gives no rank anything it does not already hold:
  every rank receives the noiseless global clipped sum from the all-reduce before the noise is added.  Each rank's
  Poisson sampling uses its own OS-drawn key (independent inclusions).
"""

from __future__ import annotations

import math
import secrets
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["SecureRandom", "TorchNoise", "BLOCK", "KEY_BYTES", "NORMALS_PER_DRAW", "TORCH_GENERATORS",
           "describe_torch_generator"]

KEY_BYTES = 32
NORMALS_PER_DRAW = 4  # Holohan-Braghin: (N1 + ... + N4) / 2
BLOCK = 1 << 18  # noise coordinates per ChaCha20 position (4 x 2 MiB of float64 draws at a time per thread)
_CALL_SHIFT, _BLOCK_SHIFT = 64, 40  # counter of block j of draw c: c * 2^64 + j * 2^40 (a block uses < 2^22)


class SecureRandom:
    """ChaCha20 with a 256-bit OS-drawn (or given, e.g. broadcast) key: uniforms for Poisson sampling and
    Holohan-Braghin normals for noise.  ``key`` is bytes from :func:`secrets.token_bytes`, never a seed.
    ``threads``: how many threads draw the noise (default: ``torch.get_num_threads()`` at each draw); the values
    do not depend on it.  ``background``: :meth:`normals` draws the next release's noise while the step runs (the
    same values, see the module docstring)."""

    def __init__(self, key: bytes | None = None, threads: int | None = None, background: bool = True):
        from randomgen import ChaCha

        if key is not None and (not isinstance(key, bytes) or len(key) != KEY_BYTES):
            raise ValueError(f"SecureRandom takes a key of {KEY_BYTES} random bytes (secrets.token_bytes), not a seed; "
                             f"got {type(key).__name__}")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"SecureRandom: threads must be a positive integer or None, got {threads!r}")
        self.threads = threads
        key = secrets.token_bytes(KEY_BYTES) if key is None else key
        self._key = int.from_bytes(key, "little")
        self._gen = np.random.Generator(ChaCha(key=self._key, rounds=20))  # uniforms: counters from 0
        self._draws = 0  # normal() calls so far: draw c uses the counters from c * 2^64 on
        self._pool, self._pool_size = None, 0
        self.background = background
        self._ahead: ThreadPoolExecutor | None = None  # the background draw's thread
        self._pending: tuple[list, Future] | None = None  # (specs, future of their host draws)

    def __getstate__(self) -> dict[str, Any]:  # a copy (deepcopy, pickle) gets its own threads when it draws
        return {**self.__dict__, "_pool": None, "_pool_size": 0, "_ahead": None, "_pending": None}

    def describe(self) -> dict[str, Any]:
        import randomgen

        return {"generator": f"ChaCha20 (randomgen {randomgen.__version__}), 256-bit key from the OS",
                "gaussian": "Holohan-Braghin sum of 4 float64 normals / 2"}

    def uniform(self, n: int) -> Tensor:
        """``n`` float64 uniforms on [0, 1) (53 random bits each)."""
        return torch.from_numpy(self._gen.random(int(n)))

    def _block(self, draw: int, j: int, out: np.ndarray) -> None:
        """Block ``j`` of draw ``draw``: ``out`` (float64, at most :data:`BLOCK` entries) <- Holohan-Braghin normals."""
        from randomgen import ChaCha

        counter = (draw << _CALL_SHIFT) | (j << _BLOCK_SHIFT)
        gen = np.random.Generator(ChaCha(key=self._key, counter=counter, rounds=20))
        np.sum(gen.standard_normal((NORMALS_PER_DRAW, out.size)), axis=0, out=out)
        out /= np.sqrt(NORMALS_PER_DRAW)

    def _host_draw(self, draw: int, shape: Sequence[int], dtype: torch.dtype, pinned: bool, threads: int) -> Tensor:
        """Draw ``draw``'s float64 normals on the host (blocks on up to ``threads`` threads), cast to ``dtype``
        (into page-locked memory if ``pinned``)."""
        flat = np.empty(math.prod(shape))
        blocks = [(j, flat[s:s + BLOCK]) for j, s in enumerate(range(0, flat.size, BLOCK))]
        threads = min(threads, len(blocks))
        if threads > 1:
            if self._pool_size < threads:
                self._pool, self._pool_size = ThreadPoolExecutor(threads, thread_name_prefix="prismdp-secure-noise"), \
                    threads
            list(self._pool.map(lambda b: self._block(draw, *b), blocks))
        else:
            for j, out in blocks:
                self._block(draw, j, out)
        total = torch.from_numpy(flat.reshape(tuple(shape)))
        if not pinned:
            return total.to(dtype)
        # on a GPU: cast on the CPU straight into page-locked memory (half the bytes of float64 for float32), then
        # one asynchronous copy per tensor; the host does not wait for the device (costs:
        # bench/studies/secure_noise.py)
        staged = torch.empty(total.shape, dtype=dtype, pin_memory=True)
        staged.copy_(total)
        return staged

    @staticmethod
    def _spec(shape: Sequence[int], dtype: torch.dtype, device) -> tuple:
        if torch.finfo(dtype).bits < 32:
            raise ValueError(f"secure noise is drawn in float32 or wider, not {dtype}")
        return tuple(shape), dtype, torch.device(device)

    def _draw_all(self, first: int, specs: list, threads: int) -> list[Tensor]:
        return [self._host_draw(first + i, shape, dtype, device.type == "cuda", threads)
                for i, (shape, dtype, device) in enumerate(specs)]

    @staticmethod
    def _to_device(host: Tensor, device: torch.device) -> Tensor:
        return host.to(device, non_blocking=True) if device.type == "cuda" else host.to(device)

    def normal(self, shape: Sequence[int], dtype: torch.dtype, device) -> Tensor:
        """Standard normal entries of ``shape`` as ``(N1 + N2 + N3 + N4) / 2`` in float64, cast to ``dtype``."""
        return self.normals([(shape, dtype, device)])[0]

    def normals(self, specs: Sequence[tuple[Sequence[int], torch.dtype, Any]]) -> list[Tensor]:
        """One release's noise: a tensor of standard normals per ``(shape, dtype, device)``, the same values as one
        :meth:`normal` call per spec in order.  With ``background``, the draws of the next call with these specs are
        then started on a background thread."""
        specs = [self._spec(*spec) for spec in specs]
        threads = self.threads or torch.get_num_threads()
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == specs:
            host = pending[1].result()  # drawn ahead for these draw numbers (an error there is raised here)
        else:
            if pending is not None:
                pending[1].result()  # other shapes: wait for the thread (it owns the pool's blocks), drop its draws
            host = self._draw_all(self._draws + 1, specs, threads)
        self._draws += len(specs)
        out = [self._to_device(h, device) for h, (_, _, device) in zip(host, specs)]
        if self.background:
            if self._ahead is None:
                self._ahead = ThreadPoolExecutor(1, thread_name_prefix="prismdp-secure-noise-ahead")
            self._pending = (specs, self._ahead.submit(self._draw_all, self._draws + 1, specs, threads))
        return out

    # Checkpoints hold no key: a resumed secure run continues with a fresh OS-drawn key (see the module docstring).
    def state_dict(self) -> dict[str, Any]:
        return {"secure": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not (isinstance(state, dict) and state.get("secure")):
            raise ValueError("the checkpoint's noise came from torch's generator; this run uses secure noise "
                             "(resume with the run's own --secure-noise setting)")


#: torch's generator of each device type: its algorithm and where it draws (``torch.Generator(device=...)``; ATen's
#: CPUGeneratorImpl, CUDAGeneratorImpl and MPSGeneratorImpl)
TORCH_GENERATORS = {"cpu": "Mersenne Twister MT19937, drawn on the CPU",
                    "cuda": "Philox4x32-10, counter-based, drawn on the GPU",
                    "mps": "Philox4x32, counter-based, drawn on the GPU"}


def describe_torch_generator(device: torch.device | str) -> str:
    """What privacy.json says of a torch generator of ``device``: its algorithm and where the noise is drawn."""
    kind = torch.device(device).type
    return f"torch {kind} generator ({TORCH_GENERATORS.get(kind, 'the backend default, drawn on the device')})"


SEEDED_NOISE = ("the run's seed, recorded in config.json: whoever knows it can regenerate this noise, and the "
                "guarantee holds only against an adversary who does not; for noise no seed reproduces, --secure-noise "
                "or make_private(seed=None)")


class TorchNoise:
    """The default noise source: ``torch.randn`` from a torch generator (seedable, reproducible, not secure), drawn
    on the generator's device (the parameters' device: no CPU draw and copy).  ``seeded_from`` says where the
    generator's seed came from (privacy.json's ``noise_source.seed``): :data:`SEEDED_NOISE` for a run's own seed."""

    def __init__(self, generator: torch.Generator, seeded_from: str | None = None):
        self.generator = generator
        self.seeded_from = seeded_from

    def describe(self) -> dict[str, Any]:
        out = {"generator": describe_torch_generator(self.generator.device), "gaussian": "torch.randn",
               "drawn_on": str(self.generator.device)}
        return out | ({"seed": self.seeded_from} if self.seeded_from else {})

    def normal(self, shape: Sequence[int], dtype: torch.dtype, device) -> Tensor:
        return torch.randn(tuple(shape), generator=self.generator, dtype=dtype, device=device)

    def normals(self, specs: Sequence[tuple[Sequence[int], torch.dtype, Any]]) -> list[Tensor]:
        """One release's noise, one :meth:`normal` per ``(shape, dtype, device)`` in order."""
        return [self.normal(*spec) for spec in specs]

    def state_dict(self) -> Tensor:
        return self.generator.get_state()

    def load_state_dict(self, state) -> None:
        if isinstance(state, dict):
            raise ValueError("the checkpoint's run used secure noise; resume it with --secure-noise")
        self.generator.set_state(state)
