"""Figures of the diagnostics (matplotlib, Agg backend): one PNG per :class:`~.studies.Result`."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from ..engine import METHODS
from .runs import COMPARED

__all__ = ["save_figure"]

COLORS = {"dp-adamw": "tab:red", "prism": "tab:blue"}
Z_NOISE = "weight units per unit lr"


def _plt():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("prismdp diagnose needs matplotlib: pip install 'prismdp[plots]'") from e
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _finish(fig, title: str, note: str, path: Path, *, hspace: float = 0.3, wspace: float = 0.22) -> None:
    """Title, a footnote with the caption under the axes (the figure grows to fit it), save, close."""
    import matplotlib.pyplot as plt

    w, h = fig.get_size_inches()
    width_chars = int(w * 72 / (8.5 * 0.55))  # characters of an 8.5 pt font per line
    lines = textwrap.wrap(note, width_chars)
    foot = (len(lines) * 8.5 * 1.35) / 72 + 0.15
    H = h + foot
    fig.set_size_inches(w, H)
    fig.subplots_adjust(left=0.9 / w, right=1 - 0.15 / w, top=1 - 0.85 / H, bottom=(foot + 0.75) / H,
                        hspace=hspace, wspace=wspace)
    fig.suptitle(title, fontsize=14, fontweight="bold", y=1 - 0.2 / H)
    fig.text(0.01, 0.1 / H, "\n".join(lines), fontsize=8.5, va="bottom", ha="left", color="0.2")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _positive(x, floor):
    x = np.asarray(x, dtype=float)
    return np.where(np.isfinite(x) & (x > floor), x, np.nan)


# ---------------------------------------------------------------------------------------------- figures


def _gauge_training(res, path):
    plt = _plt()
    p = res.plot
    t = p["steps"]
    fig, axes = plt.subplots(2, 4, figsize=(20, 9.0))
    metrics = [("clip_fraction", "clipped fraction", "fraction of examples clipped"),
               ("clip_coef_mean", "mean clip coefficient", "mean of min(1, C/||g_i||)"),
               ("dz_norm", "realised step ||Z_{t+1} - Z_t||_F", "sum over modules of ||dZ||_F (weight units)")]
    for i, method in enumerate(COMPARED):
        for j, (key, name, ylabel) in enumerate(metrics):
            ax = axes[i, j]
            b = p["bands"][method][key]
            col = COLORS[method]
            ax.fill_between(t, b.min, b.max, color=col, alpha=0.13, lw=0, label="min-max over c")
            ax.fill_between(t, b.q25, b.q75, color=col, alpha=0.35, lw=0, label="inter-quartile range over c")
            ax.plot(t, b.mean, color=col, lw=1.8, label="mean over c")
            ax.set_title(f"{METHODS[method].label}: {name}", fontsize=11)
            ax.set_xlabel("optimizer step")
            ax.set_ylabel(ylabel)
            if key != "dz_norm":
                ax.set_ylim(-0.03, 1.03)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="best")
    # range indices
    for i, (key, name, ylabel) in enumerate([("dz_norm", "rho_t = max_c ||dZ_t||_F - min_c ||dZ_t||_F",
                                              "rho_t (weight units, log scale)"),
                                             ("clip_coef_mean", "range over c of the mean clip coefficient",
                                              "max_c - min_c (log scale)")]):
        ax = axes[i, 3]
        floor = 1e-12
        for method in COMPARED:
            v = np.asarray(p["rho"][method][key], dtype=float)
            ax.plot(t, np.maximum(v, floor), color=COLORS[method], lw=1.8, marker="o" if method == "prism" else "s",
                    ms=4, ls="-" if method == "prism" else "--", label=METHODS[method].label)
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor / 10)
        ax.set_title(name, fontsize=11)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=9)
    gauges = ", ".join(f"{c:g}" for c in p["gauges"])
    _finish(fig, f"Issue I - gauge sensitivity: DP training from equivalent starts (cA, B/c), c in {{{gauges}}}",
            "Every run starts from the same model function (Z = A B^T is unchanged by c), with the same seed, batches "
            "and noise stream; only the factorisation differs. A gauge-invariant mechanism gives identical runs "
            "(bands collapse to the mean line, range ~ 0; values below 1e-12 drawn at 1e-12). " + res.caption, path,
            hspace=0.35, wspace=0.28)


def _gauge_sweep(res, path):
    plt = _plt()
    p = res.plot
    c, st = p["c"], p["stats"]
    fig, axes = plt.subplots(1, 2, figsize=(17, 6.5))
    ax = axes[0]
    series = [("first", "factor space, first order xi_A B^T + A xi_B^T", "tab:red"),
              ("bilinear", "factor space, bilinear eta xi_A xi_B^T", "tab:orange"),
              ("prism", "PRISM, tangent noise tau P_Z(Xi)", "tab:blue")]
    for key, label, col in series:
        s = st[key]
        ax.fill_between(c, s["p10"], s["p90"], color=col, alpha=0.25, lw=0)
        ax.plot(c, s["median"], color=col, lw=2.5, label=f"{label}: median, 10-90% band")
    for k, (key, _, _) in enumerate(series):
        ax.plot(c, np.sqrt(st[key]["theory"]), color="k", lw=1.1, ls="--", zorder=5,
                label="closed forms sqrt(E||N_Z||_F^2)" if k == 0 else None)
    ax.axvline(p["c_star"], color="0.3", ls=":", lw=1.2, label=f"c* = {p['c_star']:.3g} (minimum of the first order)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("gauge scale c in (A, B) -> (cA, B/c)  (dimensionless, log scale)")
    ax.set_ylabel(f"intrinsic noise ||N_Z||_F ({Z_NOISE}, log scale)")
    ax.set_title(f"Intrinsic noise at fixed Z ({p['m']}x{p['n']}, rank {p['r']}), tau = {p['tau']:.3g}, "
                 f"eta = {p['eta']:g}", fontsize=11)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8.5, loc="center", bbox_to_anchor=(0.5, 0.4), framealpha=0.9)
    ax = axes[1]
    ax.plot(c, p["amp"], color="tab:purple", lw=2, label="Monte Carlo: median factor space (all terms) / median PRISM")
    ax.plot(c, p["amp_theory"], color="k", lw=1.2, ls="--", label="closed form sqrt(E factor / E PRISM)")
    ax.axhline(1.0, color="0.5", lw=1)
    ax.axvline(p["c_star"], color="0.3", ls=":", lw=1.2, label=f"c* = {p['c_star']:.3g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("gauge scale c (dimensionless, log scale)")
    ax.set_ylabel("amplification factor (dimensionless, log scale)")
    ax.set_title("Amplification of the intrinsic noise by factor-space DP over PRISM", fontsize=11)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=9)
    _finish(fig, "Issue II - gauge sweep: same Z, different factorisations, factor-space DP noise vs PRISM",
            res.caption, path)


def _noise_vs_s(res, path):
    plt = _plt()
    p = res.plot
    P, Q, tau = p["points"], p["prism"], p["tau"]
    fig, axes = plt.subplots(1, 2, figsize=(17, 6.5))
    cmap = plt.get_cmap("viridis")
    gauges = list(p["gauges"])
    ax = axes[0]
    for k, cval in enumerate(gauges):
        sel = P[:, 0] == cval
        ax.scatter(P[sel, 2], P[sel, 3], s=14, color=cmap(k / max(len(gauges) - 1, 1)),
                   label=f"DP-AdamW steps, start gauge c = {cval:g}")
    xs = np.geomspace(min(P[:, 2].min(), Q[:, 2].min()) / 1.5, max(P[:, 2].max(), Q[:, 2].max()) * 1.5, 100)
    ax.plot(xs, tau**2 * xs, "k--", lw=1.2, label="theory for factor space: E||N_Z||^2 = tau^2 S_t")
    ax.axhline(p["level"], color="tab:blue", lw=1.5, label="PRISM theory: tau^2 sum r(m+n-r) (independent of S_t)")
    ax.scatter(Q[:, 2], Q[:, 3], s=22, marker="x", color="tab:blue", label="PRISM steps (at its own S_t)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("S_t = sum_l s_l (m_l ||B_l||^2 + n_l ||A_l||^2)  (squared factor-norm units, log scale)")
    ax.set_ylabel(f"measured ||N_Z||_F^2 ({Z_NOISE}, squared, log scale)")
    ax.set_title(f"Intrinsic noise energy vs the gauge statistic S_t (tau = {tau:.3g})", fontsize=11)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8.5)
    ax = axes[1]
    for k, cval in enumerate(gauges):
        sel = P[:, 0] == cval
        ax.plot(P[sel, 1], P[sel, 3] / (tau**2 * P[sel, 2]), marker="o", ms=3, lw=1,
                color=cmap(k / max(len(gauges) - 1, 1)), label=f"DP-AdamW, c = {cval:g}")
    ax.axhline(1.0, color="k", ls="--", lw=1.2, label="theory: 1")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("||N_Z||^2 / (tau^2 S_t)  (dimensionless)")
    ax.set_title("Measured / predicted factor-space noise energy, per step", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8.5)
    _finish(fig, "Issue II - factor-space DP noise on Z grows with the factor norms S_t; PRISM's does not",
            res.caption, path)


def _amplification(res, path):
    plt = _plt()
    p = res.plot
    t = p["steps"]
    fig, axes = plt.subplots(2, 2, figsize=(17, 10))
    ax = axes[0, 0]
    ax.plot(t, p["ratio"].mean(0), color="tab:blue", lw=1, alpha=0.7, label="per-step ratio")
    ax.plot(t, p["ratio_ma"].mean(0), color="tab:orange", lw=2.2, label=f"trailing moving average (window {p['window']}; shorter before step {p['window']})")
    ax.axhline(1.0, color="0.4", ls="--", lw=1, label="equal noise (ratio 1)")
    ax.set_title("(a) Intrinsic noise ratio ||N_Z||_F DP-AdamW / ||N_Z||_F PRISM", fontsize=11)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("ratio of noise norms (dimensionless)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    panels = [(axes[0, 1], p["amp"], "(b) Preconditioned-noise amplification ||P^-1/2 xi||_Z / ||xi||_Z",
               "amplification (dimensionless, log scale)"),
              (axes[1, 0], p["aggr"], "(c) Preconditioner aggressiveness max_modules ||P^-1/2||_2",
               "max ||P^-1/2||_2 (1 / gradient units, log scale)"),
              (axes[1, 1], p["stress"], "(d) Gram stress max_modules ||M^-1/2||_2, M = A^T A",
               "1 / sigma_min(A) (1 / factor units, log scale)")]
    for ax, vals, title, ylabel in panels:
        for m in COMPARED:
            ax.plot(t, _positive(np.asarray(vals[m]).mean(0), 0.0), color=COLORS[m], lw=1.8, marker="o", ms=2.5,
                    label=METHODS[m].label)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=9)
    _finish(fig, "Issues II-III - intrinsic DP noise and how the optimizers' preconditioners rescale it", res.caption,
            path)


def _sigma_sweep(res, path):
    plt = _plt()
    p = res.plot
    fig, axes = plt.subplots(1, 3, figsize=(19, 6.0))
    panels = [("raw_noise", "Raw intrinsic noise ||N_Z||_F", f"||N_Z||_F ({Z_NOISE})", False),
              ("precond_noise", "Preconditioned intrinsic noise ||P^-1/2 xi||_Z", f"||P^-1/2 xi||_Z ({Z_NOISE}, log)",
               True),
              ("amplification", "Amplification ||P^-1/2 xi||_Z / ||xi||_Z", "amplification (dimensionless, log)", True)]
    for ax, (key, title, ylabel, logy) in zip(axes, panels):
        for m in COMPARED:
            d = p[m]
            order = np.argsort(d["sigma"])
            ax.errorbar(d["sigma"][order], d[f"{key}_mean"][order], yerr=d[f"{key}_std"][order], color=COLORS[m],
                        marker="o", capsize=3, lw=1.8, label=f"{METHODS[m].label}: mean +- sd over steps")
            if key == "raw_noise":
                ax.plot(d["sigma"][order], d["raw_noise_theory"][order], color="k", ls="--", lw=1.1, zorder=5,
                        label="theory: PRISM tau sqrt(sum r(m+n-r)), DP-AdamW tau sqrt(mean S_t)"
                        if m == COMPARED[-1] else None)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("realised noise multiplier sigma (dimensionless)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=11)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8.5)
    _finish(fig, "Issue III - DP noise vs the noise multiplier sigma, before and after adaptive preconditioning",
            res.caption, path)


_FIGURES = {
    "gauge-training": _gauge_training,
    "gauge-sweep": _gauge_sweep,
    "noise-vs-S": _noise_vs_s,
    "amplification": _amplification,
    "sigma-sweep": _sigma_sweep,
}


def save_figure(res, path: str | Path) -> Path:
    """Draw ``res`` (an :class:`~.studies.Result`) to ``path`` (PNG)."""
    path = Path(path)
    _FIGURES[res.name](res, path)
    return path
