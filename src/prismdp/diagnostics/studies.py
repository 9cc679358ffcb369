"""The five diagnostics of paper Sec. 4 / App. C: run the measurements, return tables (no plotting here).

Each function takes a :class:`~prismdp.diagnostics.runs.Session` and returns a :class:`Result`: the CSV table
(``columns``, ``rows``), its caption, the arrays :mod:`prismdp.diagnostics.plots` draws, and a few key numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..lora import get_factors
from . import measures
from .runs import COMPARED, Session

__all__ = ["Result", "DIAGNOSTICS", "DEFAULT_STEPS", "gauge_training", "gauge_sweep", "noise_vs_s",
           "amplification", "sigma_sweep"]

DEFAULT_STEPS = {"gauge-training": 30, "gauge-sweep": 60, "noise-vs-S": 30, "amplification": 60, "sigma-sweep": 120}


@dataclass
class Result:
    name: str
    caption: str
    columns: list[str]
    rows: list[list]
    plot: dict = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)


def _steps(session: Session, name: str) -> int:
    return session.settings.steps or DEFAULT_STEPS[name]


def _setup(session: Session, steps: int, sigma: float | None = None) -> str:
    s, cfg = session.settings, session.settings.run
    lr = ", ".join(f"{m} {session.lr_for(m):g}" for m in COMPARED)
    sig = f", sigma {sigma:.3f}" if sigma is not None else ""
    start = "PEFT init (lora_B = 0)" if s.baseline_start == "peft" else f"the same {cfg.init} rank-r start as PRISM"
    return (f"Setup: {session.describe}; LoRA rank {cfg.rank}, alpha {cfg.alpha:g} on {','.join(session.targets)}; "
            f"Poisson batches of expected size b = {cfg.batch_size:g} (q = {session.sample_rate:.4g}); C = "
            f"{cfg.max_grad_norm:g}; epsilon {cfg.epsilon:g}, delta {cfg.delta:g} over {steps} steps{sig}; lr {lr}; "
            f"seeds {','.join(map(str, s.seeds))}; PRISM starts from the compensated {cfg.init} rank-r point, "
            f"DP-AdamW from {start}.")


def _fmt(x: float) -> str:
    return f"{x:.4g}"


# ---------------------------------------------------------------------------------------------- Issue I


def gauge_training(session: Session) -> Result:
    """DP training from gauge-rescaled starts: clip statistics and realised ||dZ|| across c, per step."""
    s = session.settings
    steps = _steps(session, "gauge-training")
    metrics = ("clip_fraction", "clip_coef_mean", "dz_norm")
    arr: dict[str, dict[str, np.ndarray]] = {}
    sigma = None
    for method in COMPARED:
        per_seed = []
        for seed in s.seeds:
            per_c = []
            for c in s.gauges:
                run = session.run(method, seed, steps, gauge=c)
                sigma = run.sigma
                per_c.append(run.run_all(s.progress, f"{method} c={c:g} seed {seed}"))
            per_seed.append(per_c)
        arr[method] = {k: np.array([[[getattr(r, k) for r in recs] for recs in per_c] for per_c in per_seed])
                       for k in metrics}  # (seeds, gauges, steps)

    def seed_mean_band(v):  # spread across c per seed, averaged over seeds
        bands = [measures.band(v[i]) for i in range(v.shape[0])]
        return measures.Band(*[np.mean([getattr(b, f) for b in bands], axis=0) for f in measures.Band._fields])

    bands = {m: {k: seed_mean_band(arr[m][k]) for k in metrics} for m in COMPARED}
    rho = {m: {k: np.mean([measures.range_index(arr[m][k][i]) for i in range(len(s.seeds))], axis=0)
               for k in metrics} for m in COMPARED}
    rel_rho = {m: np.mean([measures.range_index(arr[m]["dz_norm"][i]) / arr[m]["dz_norm"][i].mean(0)
                           for i in range(len(s.seeds))], axis=0) for m in COMPARED}

    cs = [f"{c:g}" for c in s.gauges]
    columns = (["method", "seed", "step"] + [f"{k}[c={c}]" for k in metrics for c in cs]
               + ["rho_dz", "rho_dz_relative", "range_clip_coef_mean", "range_clip_fraction"])
    rows = []
    for method in COMPARED:
        for i, seed in enumerate(s.seeds):
            for t in range(steps):
                v = arr[method]
                row = [method, seed, t + 1] + [v[k][i, j, t] for k in metrics for j in range(len(cs))]
                dz = v["dz_norm"][i, :, t]
                row += [dz.max() - dz.min(), (dz.max() - dz.min()) / dz.mean(),
                        np.ptp(v["clip_coef_mean"][i, :, t]), np.ptp(v["clip_fraction"][i, :, t])]
                rows.append(row)
    caption = (
        "Issue I (gauge sensitivity): DP training from gauge-rescaled starts (A, B) -> (cA, B/c), c in "
        f"{{{', '.join(cs)}}}, which leave Z = A B^T and the model unchanged; for every c the same seed, Poisson "
        "batches and noise stream. Per step: fraction of examples clipped, mean clip coefficient "
        "alpha_i = min(1, C / ||g_i||), and the realised ||Z_{t+1} - Z_t||_F from the parameters before and after "
        "the step, summed over the LoRA modules. Range index (paper App. C, Fig. pathology1_dz_range): "
        "rho_t = max_c ||dZ_t||_F - min_c ||dZ_t||_F (a difference, not a ratio); rho_dz_relative divides it by "
        "the mean over c. Bands across c: mean line, inter-quartile band, min/max band (averaged over seeds). "
        "PRISM re-balances any start, so its runs coincide for all c (rho_t at float rounding level); DP-AdamW's "
        "factor-space clipping norm c^-2 ||g_A||^2 + c^2 ||g_B||^2 (eq. gauge_norm) depends on c. "
        + _setup(session, steps, sigma))
    summary = []
    for m in COMPARED:
        summary.append(f"{m}: mean rho_t {np.mean(rho[m]['dz_norm']):.3g} (relative {np.mean(rel_rho[m]):.3g}), "
                       f"mean range of clip coef {np.mean(rho[m]['clip_coef_mean']):.3g}, step-1 clip coef by c: "
                       + ", ".join(_fmt(x) for x in arr[m]["clip_coef_mean"][0, :, 0]))
    plot = dict(steps=np.arange(1, steps + 1), bands=bands, rho=rho, gauges=s.gauges)
    return Result("gauge-training", caption, columns, rows, plot, summary)


# ---------------------------------------------------------------------------------------------- Issue II


def _swept_factors(session: Session) -> tuple[str, torch.Tensor, torch.Tensor]:
    s = session.settings
    seed = s.seeds[0]
    _, pairs, _ = session.rank_r_pairs(seed)
    if s.module is not None:
        pairs = [p for p in pairs if s.module in p.name]
        if not pairs:
            raise ValueError(f"module: no LoRA module name contains {s.module!r}")
    if s.sweep_source == "random":
        m, n, r = pairs[0].shape
        g = torch.Generator().manual_seed(seed)
        A = 4.0 * torch.randn(m, r, generator=g, dtype=torch.float64) / math.sqrt(m)
        B = 0.25 * torch.randn(n, r, generator=g, dtype=torch.float64) / math.sqrt(n)
        return f"random rank-{r} Z of shape {m}x{n} (A ~ 4 N(0, 1/m), B ~ N(0, 1/n) / 4)", A, B
    best = max(pairs, key=lambda p: measures.gauge_statistic(*get_factors(p, torch.float64)))
    A, B = get_factors(best, torch.float64)
    m, n, r = best.shape
    return f"module {best.name} ({m}x{n}, rank {r}) at the {s.run.init} rank-r start (balanced factors)", A, B


def gauge_sweep(session: Session) -> Result:
    """Fixed Z, factors (cA, B/c) over log10 c in [-3, 3]: Monte-Carlo intrinsic noise of both mechanisms."""
    s = session.settings
    steps = _steps(session, "gauge-sweep")
    what, A, B = _swept_factors(session)
    m, n, r = A.shape[0], B.shape[0], A.shape[1]
    sigma = session.sigma(s.run.epsilon, steps)
    tau = sigma * s.run.max_grad_norm / s.run.batch_size
    eta = session.lr_for("dp-adamw")
    log10_c = np.linspace(-s.sweep_decades, s.sweep_decades, s.sweep_points)
    d = measures.gauge_sweep(A, B, tau, eta, log10_c, s.draws, torch.Generator().manual_seed(s.seeds[0]))
    theory = {"first": measures.factor_energy(A, B, tau, d.c),
              "bilinear": np.full(len(d.c), measures.bilinear_energy(m, n, r, tau, eta)),
              "prism": np.full(len(d.c), measures.prism_energy(m, n, r, tau))}
    theory["total"] = theory["first"] + theory["bilinear"]
    kinds = ("first", "bilinear", "total", "prism")
    stats = {}
    for k in kinds:
        norms = np.sqrt(getattr(d, k))
        mean, se = measures.mean_se(getattr(d, k))
        stats[k] = dict(median=np.median(norms, 1), p10=np.quantile(norms, 0.1, 1), p90=np.quantile(norms, 0.9, 1),
                        energy=mean, se=se, theory=theory[k])
    amp = stats["total"]["median"] / stats["prism"]["median"]
    amp_theory = np.sqrt(theory["total"] / theory["prism"])
    cstar = measures.c_star(A, B)
    columns = ["log10_c", "c"] + [f"{k}_{f}" for k in kinds for f in
                                  ("median_norm", "p10_norm", "p90_norm", "energy_mean", "energy_se",
                                   "energy_theory")] + ["amplification_median", "amplification_theory"]
    rows = []
    for i, (lc, c) in enumerate(zip(log10_c, d.c)):
        row = [lc, c]
        for k in kinds:
            st = stats[k]
            row += [st["median"][i], st["p10"][i], st["p90"][i], st["energy"][i], st["se"][i], st["theory"][i]]
        rows.append(row + [amp[i], amp_theory[i]])
    a2, b2 = float(A.square().sum()), float(B.square().sum())
    caption = (
        f"Issue II, gauge sweep at fixed Z (paper App. C.2, Prop. scalar_range): {what}; factors (cA, B/c) for "
        f"log10 c in linspace({-s.sweep_decades:g}, {s.sweep_decades:g}, {s.sweep_points}), {s.draws} "
        "Monte-Carlo draws per c; median and 10-90% band of the intrinsic noise ||N_Z||_F. Factor-space noise "
        "xi_A, xi_B with i.i.d. N(0, tau^2) entries on A and B, tau = sigma C / b = "
        f"{tau:.4g} (sigma {sigma:.4g} of a {steps}-step run at epsilon {s.run.epsilon:g}), step eta = {eta:g}: first "
        "order xi_A B^T + A xi_B^T with E||.||^2 = tau^2 (m ||B/c||_F^2 + n ||cA||_F^2) = tau^2 (m ||B||^2 / c^2 + "
        "n c^2 ||A||^2) (the cross term has mean 0; E[xi_A^T xi_A] = m tau^2 I, E[xi_B^T xi_B] = n tau^2 I), minimal "
        f"at c* = (m ||B||^2 / (n ||A||^2))^(1/4) = {cstar:.4g} with value 2 tau^2 sqrt(mn) ||A|| ||B||; bilinear "
        "eta xi_A xi_B^T with E||.||^2 = eta^2 m n r tau^4 (gauge-free). PRISM: tau P_Z(Xi) sampled at (cA, B/c), "
        f"E||.||^2 = tau^2 r (m + n - r). Here m = {m}, n = {n}, r = {r}, ||A||_F^2 = {a2:.4g}, ||B||_F^2 = "
        f"{b2:.4g}. Amplification = median factor-space (first order + bilinear) / median PRISM; theory = "
        "sqrt of the ratio of expected energies. " + _setup(session, steps, sigma))
    i_min = int(np.argmin(stats["first"]["energy"]))
    prism_z = np.abs(stats["prism"]["energy"] - theory["prism"]) / stats["prism"]["se"]
    first_z = np.abs(stats["first"]["energy"] - theory["first"]) / stats["first"]["se"]
    summary = [f"c* = {cstar:.4g} (log10 {math.log10(cstar):+.2f}); Monte-Carlo minimum of the first-order energy at "
               f"log10 c = {log10_c[i_min]:+.2f}",
               f"amplification (median factor / median PRISM) from {amp.min():.3g} (at c = {d.c[np.argmin(amp)]:.3g})"
               f" to {amp.max():.3g} (at c = {d.c[np.argmax(amp)]:.3g})",
               f"max |MC - theory| / SE: PRISM {prism_z.max():.2f}, factor first order {first_z.max():.2f}"]
    plot = dict(c=d.c, stats=stats, amp=amp, amp_theory=amp_theory, c_star=cstar, tau=tau, eta=eta, m=m, n=n, r=r)
    return Result("gauge-sweep", caption, columns, rows, plot, summary)


def noise_vs_s(session: Session) -> Result:
    """Measured ||N_Z||^2 of DP-AdamW's noise against S_t (runs from several gauges), PRISM for reference."""
    s = session.settings
    steps = _steps(session, "noise-vs-S")
    rows, points, prism_pts = [], [], []
    tau = sigma = None
    level = None
    for seed in s.seeds:
        for method, gauges in (("dp-adamw", s.gauges), ("prism", [1.0])):
            for c in gauges:
                run = session.run(method, seed, steps, gauge=c)
                tau, sigma = run.tau, run.sigma
                level = tau**2 * sum(r * (m + n - r) for m, n, r in run.shapes)
                for rec in run.run_all(s.progress, f"{method} c={c:g} seed {seed}"):
                    rows.append([method, seed, c, rec.step, rec.S, tau**2 * rec.S, level, rec.noise_sq,
                                 rec.noise_sq / (tau**2 * rec.S)])
                    (points if method == "dp-adamw" else prism_pts).append((c, rec.step, rec.S, rec.noise_sq))
    columns = ["method", "seed", "c", "step", "S_t", "tau2_S_t", "prism_level_tau2_r(m+n-r)", "noise_sq",
               "noise_sq_over_tau2_S_t"]
    P = np.array(points)
    Q = np.array(prism_pts)
    ratio = P[:, 3].sum() / (tau**2 * P[:, 2].sum())
    slope = np.polyfit(np.log(P[:, 2]), np.log(P[:, 3]), 1)[0] if np.ptp(P[:, 2]) > 0 else math.nan
    caption = (
        "Issue II (gauge-dependent intrinsic noise): measured energy ||N_Z||_F^2 = sum over modules of "
        "||xi_A B^T + A xi_B^T||_F^2 of the noise each DP-AdamW step actually added (first order, per unit learning "
        "rate, at the factors the step started from), against S_t = sum_l s_l (m_l ||B_l||_F^2 + n_l ||A_l||_F^2) "
        "(A = sqrt(s) W_B, B = sqrt(s) W_A^T with the LoRA scaling s = alpha / r; the paper's S_t when s = 1). "
        f"Runs start from the gauges c in {{{', '.join(f'{c:g}' for c in s.gauges)}}}, which spread S_t; they share "
        "the seed, hence the noise draws, so their per-step fluctuations around the theory coincide. Theory "
        f"(Prop. amp): E||N_Z||^2 = tau^2 S_t with tau = sigma C / b = {tau:.4g}. PRISM's noise "
        f"energy is tau^2 sum_l r (m_l + n_l - r) = {level:.4g} whatever the factors (Thm. noise_energy); its "
        "measured values from a PRISM run are drawn at that run's own S_t. " + _setup(session, steps, sigma))
    summary = [f"DP-AdamW: sum ||N_Z||^2 / sum tau^2 S_t = {ratio:.4f} over {len(P)} steps; log-log slope "
               f"{slope:.3f}; S_t from {P[:, 2].min():.4g} to {P[:, 2].max():.4g}",
               f"PRISM: mean measured ||N_Z||^2 / theory level = {Q[:, 3].mean() / level:.4f}"]
    plot = dict(points=P, prism=Q, tau=tau, level=level, gauges=s.gauges)
    return Result("noise-vs-S", caption, columns, rows, plot, summary)


# ---------------------------------------------------------------------------------------------- Issues II + III


def amplification(session: Session) -> Result:
    """Per-step intrinsic noise ratio factor/PRISM, preconditioned-noise amplification, aggressiveness, stress."""
    s = session.settings
    steps = _steps(session, "amplification")
    recs = {}
    sigma = None
    for seed in s.seeds:
        for method in COMPARED:
            run = session.run(method, seed, steps)
            sigma = run.sigma
            recs[method, seed] = run.run_all(s.progress, f"{method} seed {seed}")
    keys = ("noise_sq", "precond_noise_sq", "aggressiveness", "gram_stress")
    v = {(m, k): np.array([[getattr(r, k) for r in recs[m, seed]] for seed in s.seeds]) for m in COMPARED for k in keys}
    amp = {m: np.sqrt(v[m, "precond_noise_sq"] / v[m, "noise_sq"]) for m in COMPARED}
    ratio = np.sqrt(v["dp-adamw", "noise_sq"] / v["prism", "noise_sq"])  # (seeds, steps)
    ratio_ma = np.array([measures.moving_average(x, s.window) for x in ratio])
    columns = ["seed", "step", "noise_norm_dp-adamw", "noise_norm_prism", "ratio_factor_over_prism",
               f"ratio_moving_average_w{s.window}", "precond_noise_norm_dp-adamw", "precond_noise_norm_prism",
               "amplification_dp-adamw", "amplification_prism", "aggressiveness_dp-adamw", "aggressiveness_prism",
               "gram_stress_dp-adamw", "gram_stress_prism"]
    rows = []
    for i, seed in enumerate(s.seeds):
        for t in range(steps):
            fac, pri = (lambda k: v["dp-adamw", k][i, t]), (lambda k: v["prism", k][i, t])
            rows.append([seed, t + 1, math.sqrt(fac("noise_sq")), math.sqrt(pri("noise_sq")), ratio[i, t],
                         ratio_ma[i, t], math.sqrt(fac("precond_noise_sq")), math.sqrt(pri("precond_noise_sq")),
                         amp["dp-adamw"][i, t], amp["prism"][i, t], fac("aggressiveness"), pri("aggressiveness"),
                         fac("gram_stress"), pri("gram_stress")])
    caption = (
        "Issues II-III, per step of one DP-AdamW and one PRISM run (same seed and batches): (a) ratio of the intrinsic "
        "noise norms ||N_Z||_F(DP-AdamW) / ||N_Z||_F(PRISM), where N_Z is the noise the step actually added, mapped "
        f"to the merged updates Z (first order, per unit learning rate), with its trailing moving average (window "
        f"{s.window}); (b) preconditioned-noise amplification ||P^-1/2 xi||_Z / ||xi||_Z: the same noise after the "
        "optimizer's preconditioner (Adam: elementwise 1 / (sqrt(v_hat) + eps) after the step's update; PRISM: the "
        "rank-space right factors (V + lambda I)^-1/2 with its DP-aware floors), both mapped to Z; (c) "
        "aggressiveness max over modules of ||P^-1/2||_2 (Adam: max_i 1 / (sqrt(v_hat_i) + eps); PRISM: largest "
        "eigenvalue of (V + lambda I)^-1/2); (d) Gram stress max over modules of ||M^-1/2||_2 = 1 / sigma_min(A) for "
        "M = A^T A, A = sqrt(s) W_B, at the factors the step started from (infinite, not drawn, where A = 0: "
        "PEFT's lora_B = 0 init). Momentum is not applied. " + _setup(session, steps, sigma))
    summary = [f"mean ratio factor/PRISM {ratio.mean():.3f} (moving average at the last step "
               f"{ratio_ma[:, -1].mean():.3f})",
               f"mean amplification: DP-AdamW {amp['dp-adamw'].mean():.4g}, PRISM {amp['prism'].mean():.4g}",
               f"max aggressiveness: DP-AdamW {v['dp-adamw', 'aggressiveness'].max():.4g}, PRISM "
               f"{v['prism', 'aggressiveness'].max():.4g}",
               "median Gram stress: DP-AdamW "
               f"{np.median(v['dp-adamw', 'gram_stress']):.4g}, PRISM {np.median(v['prism', 'gram_stress']):.4g}"]
    plot = dict(steps=np.arange(1, steps + 1), ratio=ratio, ratio_ma=ratio_ma, amp=amp,
                aggr={m: v[m, "aggressiveness"] for m in COMPARED},
                stress={m: v[m, "gram_stress"] for m in COMPARED}, window=s.window)
    return Result("amplification", caption, columns, rows, plot, summary)


def sigma_sweep(session: Session) -> Result:
    """epsilon sweep at fixed (C, delta): raw / preconditioned intrinsic noise and amplification vs sigma."""
    s = session.settings
    steps = _steps(session, "sigma-sweep")
    if s.burn_in >= steps:
        raise ValueError(f"burn_in ({s.burn_in}) must be smaller than steps ({steps})")
    rows = []
    agg = {m: [] for m in COMPARED}
    for eps in s.epsilons:
        for method in COMPARED:
            for seed in s.seeds:
                run = session.run(method, seed, steps, epsilon=eps)
                kept = run.run_all(s.progress, f"{method} eps={eps:g} seed {seed}")[s.burn_in:]
                raw = np.sqrt([r.noise_sq for r in kept])
                pre = np.sqrt([r.precond_noise_sq for r in kept])
                amp = pre / raw
                if method == "prism":
                    theory = run.tau * math.sqrt(sum(r * (m + n - r) for m, n, r in run.shapes))
                else:
                    theory = run.tau * math.sqrt(np.mean([r.S for r in kept]))
                row = [method, eps, run.sigma, seed, len(kept), raw.mean(), raw.std(), theory, pre.mean(), pre.std(),
                       amp.mean(), amp.std()]
                rows.append(row)
                agg[method].append(row)
    columns = ["method", "epsilon", "sigma", "seed", "steps_used", "raw_noise_mean", "raw_noise_std",
               "raw_noise_theory", "precond_noise_mean", "precond_noise_std", "amplification_mean",
               "amplification_std"]
    caption = (
        f"Issue III (DP noise under adaptive preconditioning): epsilon in {{{', '.join(f'{e:g}' for e in s.epsilons)}}}"
        f" at fixed C = {s.run.max_grad_norm:g}, delta = {s.run.delta:g}, {steps} steps each, the first {s.burn_in} "
        "discarded; x-axis: the realised noise multiplier sigma calibrated for each run. Per step: raw intrinsic "
        "noise ||N_Z||_F (the noise the step actually added, mapped to the merged updates Z, first order, per unit "
        "learning rate, summed over modules as a root-sum-square), the preconditioned ||P^-1/2 xi||_Z (Adam's "
        "diagonal / PRISM's floored rank-space preconditioner applied to that noise, then mapped to Z) and the "
        "amplification = their ratio; markers are means over the kept steps, error bars +- 1 standard deviation. "
        "Theory for the raw noise: PRISM tau sqrt(sum_l r (m_l + n_l - r)), DP-AdamW tau sqrt(mean S_t), "
        "tau = sigma C / b. " + _setup(session, steps))
    summary = []
    for m in COMPARED:
        a = np.array([[r[columns.index(f)] for f in ("sigma", "raw_noise_mean", "precond_noise_mean",
                                                      "amplification_mean")] for r in agg[m]])
        def fmt(col):
            return ", ".join(f"{x:.3g}" for x in a[:, col])

        summary.append(f"{m}: sigma {fmt(0)} -> raw {fmt(1)}; preconditioned {fmt(2)}; amplification {fmt(3)}")
    fields = ("sigma", "raw_noise_mean", "raw_noise_std", "raw_noise_theory", "precond_noise_mean",
              "precond_noise_std", "amplification_mean", "amplification_std")
    plot = {m: {f: np.array([r[columns.index(f)] for r in agg[m]], dtype=float) for f in fields} for m in COMPARED}
    return Result("sigma-sweep", caption, columns, rows, plot, summary)


DIAGNOSTICS = {
    "gauge-training": gauge_training,
    "gauge-sweep": gauge_sweep,
    "noise-vs-S": noise_vs_s,
    "amplification": amplification,
    "sigma-sweep": sigma_sweep,
}
