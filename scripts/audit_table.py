"""Rebuild docs/privacy-audit.md's table "the same runs, both bounds" from the stored scores and coins
(docs/privacy-audit/fdp/*-canaries.json beside each run's audit.json), under a threshold rule.

    python scripts/audit_table.py docs/privacy-audit/fdp            # the ladder (prismdp audit's rule)
    python scripts/audit_table.py docs/privacy-audit/fdp --rule hull  # jax_privacy's rule, for comparison
    python scripts/audit_table.py --simulate                       # the simulated audits of the same page
"""

import argparse
import json
from pathlib import Path

import numpy as np

from prismdp.audit.fdp import audit_one_run_fdp
from prismdp.audit.run import fdp_report
from prismdp.audit.statistics import audit_one_run

NAMES = {"prism": "PRISM", "dp-adamw": "DP-AdamW"}


def rows(folder: Path, rule: str):
    for method in NAMES:
        for eps in (1, 3, 8):
            for k in (1, 2, 3):
                run = folder / f"tiny-{method}-eps{eps}-r{k}"
                audit = json.loads(run.with_suffix(".json").read_text())
                stored = json.loads(Path(f"{run}-canaries.json").read_text())
                scores, bits = np.asarray(stored["scores"], float), np.asarray(stored["included"], bool)
                found = audit_one_run(scores[bits], scores[~bits], delta=audit["delta"], threshold_rule=rule)
                fdp = fdp_report(scores[bits], scores[~bits], audit, audit["significance"], threshold_rule=rule)
                yield method, audit, k, found, fdp


def simulate(rule: str, m: int = 1000, delta: float = 1e-5) -> None:
    """Audits of exactly Gaussian scores (N(0, 1) out, N(mu, 1) in: mu-GDP) at the runs' mu, and of scores with no
    signal (how often "no privacy loss" is rejected at significance 0.05)."""
    rng = np.random.default_rng(0)
    for mu in (0.25, 0.61, 1.36):
        fdp, ed = [], []
        for _ in range(40):
            bits = rng.random(m) < 0.5
            scores = rng.normal(size=m) + mu * bits
            fdp.append(audit_one_run_fdp(scores[bits], scores[~bits], delta=delta, threshold_rule=rule).eps_lower_bound)
            ed.append(audit_one_run(scores[bits], scores[~bits], delta=delta, threshold_rule=rule).eps_lower_bound)
        print(f"mu {mu}: median f-DP epsilon {np.median(fdp):.2f}, (eps, delta) {np.median(ed):.2f} (40 draws)")
    runs, fdp_alarms, ed_alarms = 4000, 0, 0
    for _ in range(runs):
        bits, scores = rng.random(m) < 0.5, rng.normal(size=m)
        fdp_alarms += audit_one_run_fdp(scores[bits], scores[~bits], delta=delta,
                                        threshold_rule=rule).mu_lower_bound > 0
        ed_alarms += audit_one_run(scores[bits], scores[~bits], delta=delta, threshold_rule=rule).eps_lower_bound > 0
    print(f"no signal ({runs} draws): f-DP bound above 0 in {fdp_alarms / runs:.2%}, (eps, delta) in "
          f"{ed_alarms / runs:.2%} (standard error {np.sqrt(0.05 * 0.95 / runs):.2%} at 5 %)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path, nargs="?")
    ap.add_argument("--rule", default="ladder", choices=("ladder", "hull"))
    ap.add_argument("--simulate", action="store_true")
    args = ap.parse_args()
    if args.simulate:
        return simulate(args.rule)
    print("| method | claimed epsilon (PRV) | run | guesses | correct | (eps, delta) bound | f-DP mu | "
          "f-DP epsilon (as GDP) | noise rejected above (run's sigma) | f-DP epsilon (accountant) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    same, ratios_gdp, ratios_mech = 0, [], []
    for method, audit, k, found, fdp in rows(args.folder, args.rule):
        s = fdp["mechanism_sigma_upper_bound"]
        print(f"| {NAMES[method]} | {audit['epsilon']:.3f} | {k} | {found.guesses} | {found.correct} | "
              f"{found.eps_lower_bound:.3f} | {fdp['gdp_mu_lower_bound']:.3f} | {fdp['gdp_eps_lower_bound']:.3f} | "
              f"{'none' if s is None else f'{s:.2f}'} ({audit['noise_multiplier']:.3f}) | "
              f"{fdp['mechanism_eps_lower_bound'] or 0:.3f} |")
        same += (fdp["gdp_guesses"], fdp["gdp_correct"]) == (found.guesses, found.correct)
        if found.eps_lower_bound > 0:
            ratios_gdp.append(fdp["gdp_eps_lower_bound"] / found.eps_lower_bound)
            ratios_mech.append((fdp["mechanism_eps_lower_bound"] or 0) / found.eps_lower_bound)
    print(f"\nf-DP and (eps, delta) chose the same guesses in {same} of 18 runs; where the (eps, delta) bound is "
          f"positive ({len(ratios_gdp)} runs) the f-DP epsilon is {np.mean(ratios_gdp):.2f} times it as GDP, "
          f"{np.mean(ratios_mech):.2f} times through the mechanism family")


if __name__ == "__main__":
    main()
