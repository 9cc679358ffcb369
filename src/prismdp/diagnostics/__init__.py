"""Mechanism diagnostics of the paper (Sec. 4 "Mechanism Diagnostics", App. C): PRISM vs factor-space DP-AdamW.

``prismdp diagnose <which>`` writes ``<which>.png`` and ``<which>.csv`` (first line ``# caption: ...``):

* ``gauge-training`` (Issue I): DP training from gauge-rescaled starts ``(cA, B/c)``; clip statistics and the
  realised ``||Z_{t+1} - Z_t||_F`` across ``c``, and the range index ``rho_t``.
* ``gauge-sweep`` (Issue II, App. C.2): fixed ``Z``, ``c`` swept over six decades; Monte-Carlo intrinsic noise of
  factor-space DP (first order and bilinear) and of PRISM against the closed forms.
* ``noise-vs-S`` (Issue II): measured ``||N_Z||^2`` of DP-AdamW against ``S_t``, PRISM's level for reference.
* ``amplification`` (Issues II, III): per-step noise ratio factor / PRISM, preconditioned-noise amplification,
  preconditioner aggressiveness and Gram stress.
* ``sigma-sweep`` (Issue III): raw / preconditioned noise and amplification against the realised ``sigma``.

Layout: :mod:`.measures` (pure functions on factors and noise), :mod:`.probe` (one instrumented optimizer step),
:mod:`.settings` (what a diagnostic depends on: a TrainConfig and the diagnostics' own knobs), :mod:`.runs` (short
training runs built like ``prismdp train``), :mod:`.studies` (the five diagnostics as tables; not to be confused with
:mod:`prismdp.experiment`, the paper's training grids), :mod:`.plots` (figures), :mod:`.table` (CSV), :mod:`.cli`
(the ``diagnose`` subcommand's arguments).
"""

from .cli import NAMES, run_diagnostic

__all__ = ["NAMES", "run_diagnostic"]
