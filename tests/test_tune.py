"""`prismdp tune`: the privacy of tuning with a random number of trials (Papernot and Steinke, ICLR 2022), and the
procedure (plan saved before any trial, resume with the same count, the best trial released with the total guarantee).

Reference values: REFERENCE was computed by the paper's public code (tensorflow/privacy,
research/hyperparameters_2022, commit 03035d5; tests/reference/tuning_reference.py says how), not by prismdp; the
negative-binomial case is also checked against Theorem 2 written out here from the paper's statement."""

import json
import math

import numpy as np
import pytest

from prismdp.cli import main
from prismdp.experiment.honest import Space, plan_tuning, run_tuning
from prismdp.privacy.tuning import TrialCount, calibrate_tuning_sigma, trial_epsilon, tuning_epsilon
from prismdp.train.config import ConfigError, TrainConfig

# (trial count, sigma, q, steps, score noise multiplier, one trial's epsilon, the whole tuning's epsilon) at delta 1e-5
REFERENCE = [
    ('geometric:10', 1.0, 0.01, 1000, None, 2.101365272, 4.103255577),
    ('geometric:10', 1.5, 0.02, 300, 10.0, 1.246283853, 2.570419285),
    ('geometric:10', 4.0, 1.0, 1, None, 1.012550628, 2.153653626),
    ('poisson:10', 1.0, 0.01, 1000, None, 2.101365272, 4.329405864),
    ('poisson:10', 1.5, 0.02, 300, 10.0, 1.246283853, 2.74133547),
    ('poisson:10', 4.0, 1.0, 1, None, 1.012550628, 2.353805891),
    ('negative-binomial:0.5:10', 1.0, 0.01, 1000, None, 2.101365272, 3.820729343),
    ('negative-binomial:0.5:10', 1.5, 0.02, 300, 10.0, 1.246283853, 2.369191703),
    ('negative-binomial:0.5:10', 4.0, 1.0, 1, None, 1.012550628, 1.972410275),
    ('logarithmic:10', 1.0, 0.01, 1000, None, 2.101365272, 3.517809741),
    ('logarithmic:10', 1.5, 0.02, 300, 10.0, 1.246283853, 2.156578235),
    ('logarithmic:10', 4.0, 1.0, 1, None, 1.012550628, 1.78158935),
]


@pytest.mark.parametrize("spec,sigma,q,steps,score,trial,total", REFERENCE)
def test_epsilons_match_the_papers_reference_code(spec, sigma, q, steps, score, trial, total):
    """Geometric and Poisson: the reference code's formulas are the library's, so equal.  Negative binomial and
    logarithmic: the reference code keeps log(1 - gamma) terms that the published Theorem 2 (and dp_accounting) bound
    away, so prismdp is at most 0.5% above it and never below (never less private than the paper's own numbers)."""
    count = TrialCount.parse(spec)
    assert trial_epsilon(sigma, q, steps, 1e-5, score) == pytest.approx(trial, rel=1e-5)
    mine = tuning_epsilon(sigma, q, steps, 1e-5, count, score)
    if count.family in ("geometric", "poisson"):
        assert mine == pytest.approx(total, rel=1e-4)
    else:
        assert total <= mine <= 1.005 * total
    assert mine > 1.5 * trial  # the whole tuning costs more than one trial


def _gamma(mean, eta):
    """Definition 1's gamma for E[K] = mean, by bisection on the mean eta (1 - gamma) / (gamma (1 - gamma^eta))."""
    lo, hi = 1e-12, 1 - 1e-12
    for _ in range(200):
        mid = (lo + hi) / 2
        m = eta * (1 - mid) / (mid * (1 - mid ** eta))
        lo, hi = (mid, hi) if m > mean else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize("eta,mean,sigma", [(0.5, 10, 4.0), (1.0, 5, 2.0), (2.0, 20, 6.0)])
def test_negative_binomial_epsilon_is_theorem_2_written_out(eta, mean, sigma):
    """Theorem 2 for the (unsubsampled) Gaussian mechanism, RDP(l) = l / (2 sigma^2): the tuning is (l, e')-RDP with
    e' = RDP(l) + (1+eta)(1 - 1/l^)RDP(l^) + (1+eta) log(1/gamma)/l^ + log E[K]/(l - 1), minimised over l^;
    then (eps, delta) by eps = e' + log(1 - 1/l) - log(delta l)/(l - 1) (Canonne, Kamath, Steinke 2020)."""
    orders = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024])
    rdp = orders / (2 * sigma ** 2)
    gamma, delta = _gamma(mean, eta), 1e-5
    c = (1 + eta) * np.min((1 - 1 / orders) * rdp + math.log(1 / gamma) / orders)
    tuned = rdp + c + math.log(mean) / (orders - 1)
    tuned = np.array([tuned[orders >= a].min() for a in orders])  # RDP is monotone in the order
    expected = np.min(tuned + np.log1p(-1 / orders) - np.log(delta * orders) / (orders - 1))
    assert tuning_epsilon(sigma, 1.0, 1, delta, TrialCount.of("negative-binomial", mean, eta)) == \
        pytest.approx(expected, rel=1e-6)


def _tnb_pmf(k, eta, gamma):
    """Definition 1: P[K = k] = (1 - gamma)^k / (gamma^-eta - 1) * prod_{l < k} (l + eta) / (l + 1), k >= 1."""
    return (1 - gamma) ** k / (gamma ** -eta - 1) * math.prod((l + eta) / (l + 1) for l in range(k))


@pytest.mark.parametrize("spec", ["geometric:4", "negative-binomial:0.5:4", "poisson:4"])
def test_the_trial_count_follows_its_distribution(spec):
    """Draws of K against the pmf of the paper's Definition 1 (Poisson: e^-mu mu^k / k!), within 5 standard errors."""
    count, n = TrialCount.parse(spec), 20000
    rng = np.random.default_rng(0)
    draws = np.array([count.sample(rng) for _ in range(n)])
    for k in range(0, 6):
        p = math.exp(-4) * 4 ** k / math.factorial(k) if count.family == "poisson" else \
            (_tnb_pmf(k, count.shape, _gamma(4, count.shape)) if k else 0.0)
        assert abs(np.mean(draws == k) - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-9, (k, p)
    assert draws.mean() == pytest.approx(4, rel=0.05)


def _tiny(tmp_path, **kw):
    return TrainConfig(task="sst2", holdout_val=10, steps=2, batch_size=10.0, delta=1e-3, epsilon=3.0,
                       output=str(tmp_path / "tune"), **kw)


def test_the_count_is_drawn_at_random_for_every_tuning(tmp_path):
    """The procedure runs the K it draws, not a fixed K accounted as if random: over 400 tunings the drawn counts
    follow the geometric distribution (P[K = 1] = 1/mean, P[K = 2] = (1 - 1/mean)/mean)."""
    space, count = Space((1e-3, 1e-2)), TrialCount.parse("geometric:3")
    cfg = _tiny(tmp_path)
    drawn = np.array([plan_tuning(cfg, space, count, tune_seed=s, dataset=(50, 10), log=lambda *a: None
                                  ).drawn for s in range(400)])
    for k, p in ((1, 1 / 3), (2, 2 / 9)):
        assert abs(np.mean(drawn == k) - p) <= 5 * math.sqrt(p * (1 - p) / 400)
    plan = plan_tuning(_tiny(tmp_path), space, count, tune_seed=7, dataset=(50, 10), log=lambda *a: None)
    assert len(plan.trials) == plan.drawn and plan.epsilon <= 3.0 and plan.epsilon >= 0.99 * 3.0
    assert plan.trial_epsilon < plan.epsilon / 1.3


def test_calibration_meets_the_total_and_refuses_an_unreachable_one():
    count = TrialCount.parse("geometric:10")
    sigma = calibrate_tuning_sigma(3.0, 1e-5, 0.01, 1000, count, 10.0)
    assert 0.995 * 3.0 <= tuning_epsilon(sigma, 0.01, 1000, 1e-5, count, 10.0) <= 3.0
    assert tuning_epsilon(sigma * 0.99, 0.01, 1000, 1e-5, count, 10.0) > 3.0
    with pytest.raises(ValueError, match="raise --score-noise"):
        calibrate_tuning_sigma(0.05, 1e-5, 0.01, 1000, count, 1.0)


@pytest.mark.parametrize("text,err", [("geometric", "expected"), ("fixed:2.5", "whole number"), ("geometric:1", "> 1"),
                                      ("negative-binomial:0:5", "shape"), ("poisson:x", "not a number")])
def test_bad_trial_counts_are_refused(text, err):
    with pytest.raises(ValueError, match=err):
        TrialCount.parse(text)


def test_bad_settings_are_refused_before_any_training(tmp_path):
    space, count = Space((1e-3,)), TrialCount.parse("geometric:3")
    for kw, err in (({"lr": 1e-3}, "--lrs"), ({"dp": False}, "--no-dp"), ({"sigma": 1.0}, "calibrates"),
                    ({"holdout_val": None}, "--holdout-val")):
        cfg = _tiny(tmp_path, **{k: v for k, v in kw.items() if k != "holdout_val"})
        if "holdout_val" in kw:
            cfg.holdout_val = None
        with pytest.raises(ConfigError, match=err):
            plan_tuning(cfg, space, count, dataset=(50, 10))


def test_tune_end_to_end_resumes_with_the_same_count(tiny_bert_dir, tmp_path, capsys):
    """A real tuning on a tiny task: stopped after its first trial, resumed with the same K and hyperparameters (the
    first trial not trained again); the release's privacy.json states the whole tuning's epsilon (not one trial's),
    the per-trial one, the distribution and the count."""
    from test_glue8 import make_fake_glue

    from prismdp.train.loop import train

    root = make_fake_glue(tmp_path / "glue", n_train=60, n_dev=12)
    cfg = _tiny(tmp_path, model=tiny_bert_dir, data=str(root), micro_batch_size=10)
    space, count = Space((1e-3, 1e-2)), TrialCount.parse("geometric:3")
    trained = []

    def counting(c, **kw):
        trained.append(c.output)
        return train(c, **kw)

    quiet = {"progress": False, "log": lambda *a: None, "train_fn": counting}
    first = run_tuning(cfg, space, count, tune_seed=2, stop_after_trials=1, **quiet)
    assert first.best is None and first.plan.drawn == 2 and len(trained) == 1
    assert not (tmp_path / "tune" / "release").exists()
    with pytest.raises(ConfigError, match="--resume"):
        run_tuning(cfg, space, count, **quiet)
    again = run_tuning(cfg, space, count, tune_seed=99, resume=True, **quiet)  # the saved draw, not seed 99's
    assert again.plan.drawn == 2 and again.plan.trials == first.plan.trials and len(trained) == 2
    assert again.scores[1] == first.scores[1] and again.best in (1, 2)

    rel = tmp_path / "tune" / "release"
    priv = json.loads((rel / "privacy.json").read_text())
    p = again.plan
    total = tuning_epsilon(p.noise_multiplier, 10 / 50, 2, 1e-3, count, 10.0)
    assert priv["epsilon"] == pytest.approx(total) and 0.99 * 3 <= priv["epsilon"] <= 3
    assert priv["per_trial"]["epsilon"] == pytest.approx(trial_epsilon(p.noise_multiplier, 0.2, 2, 1e-3, 10.0))
    assert priv["per_trial"]["epsilon"] < priv["epsilon"] / 1.3
    assert priv["trials"]["drawn"] == 2 and priv["trials"]["distribution"]["family"] == "geometric"
    assert priv["trials"]["distribution"]["mean"] == 3 and priv["trials"]["draw"] == "seeded generator (seed 2)"
    assert (rel / "adapter" / "adapter_config.json").is_file() and "seed" not in priv["selected"]
    evals = json.loads((rel / "eval.json").read_text())
    assert "val" not in evals and "val_noisy" in evals and "validation" in evals
    trial_cfg = json.loads((tmp_path / "tune" / "trial-001" / "config.json").read_text())
    assert trial_cfg["noise_multiplier"] == p.noise_multiplier and trial_cfg["lr"] == p.trials[0]["lr"]

    argv = ["tune", "--model", tiny_bert_dir, "--task", "sst2", "--data", str(root), "--holdout-val", "10",
            "--steps", "2", "--batch-size", "10", "--micro-batch-size", "10", "--delta", "1e-3", "--epsilon", "3",
            "--lrs", "1e-3,1e-2", "--trials", "geometric:3", "--output", str(tmp_path / "tune"), "--quiet"]
    capsys.readouterr()
    assert main(argv + ["--resume"]) == 0  # everything done: nothing trained, the same release
    assert f"whole tuning: epsilon {total:.3f}" in capsys.readouterr().out
    assert main(argv) == 2 and "--resume" in capsys.readouterr().err
    assert main(argv + ["--resume", "--steps", "3"]) == 2 and "steps" in capsys.readouterr().err


def test_tune_help_names_the_guarantee(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    out = capsys.readouterr().out
    assert "WHOLE procedure" in out and "--trials" in out and "--resume" in out and "docs/tuning.md" in out
    assert "geometric:MEAN" in out and "grid" in out


def test_a_fixed_count_is_accounted_by_composition_not_as_if_random():
    """fixed:K releases the best of K trials; the theorems do not cover it, so it is the K trials composed.  Checked
    against dp_accounting's PLD accountant composing the same events here (an implementation independent of the
    Opacus PRV accountant prismdp uses): at K = 16 the composition (~19.4) is far above what the random-count bound
    with the same mean would give (~15.6), so accounting the fixed K as if random fails this test."""
    from dp_accounting import dp_event, pld

    sigma, q, steps, k, delta = 0.4586, 128 / 8999, 40, 16, 1e-5
    acc = pld.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), k * steps)
    acc.compose(dp_event.GaussianDpEvent(10.0), k)
    composed = acc.get_epsilon(delta)
    fixed = tuning_epsilon(sigma, q, steps, delta, TrialCount.parse(f"fixed:{k}"), 10.0)
    assert fixed == pytest.approx(composed, rel=0.01)
    assert tuning_epsilon(sigma, q, steps, delta, TrialCount.parse(f"geometric:{k}"), 10.0) < 0.85 * fixed
    assert TrialCount.parse("fixed:3").sample(np.random.default_rng(0)) == 3


def test_grid_tries_every_combination_once_and_meets_the_total(tmp_path):
    from prismdp.experiment.honest import parse_trials

    space = Space((1e-3, 1e-2), ranks=(4, 8))
    count, grid = parse_trials("grid", space)
    cfg = _tiny(tmp_path, accountant="rdp")  # the composition by the run's accountant (Opacus' RDP: fast here)
    plan = plan_tuning(cfg, space, count, grid=grid, dataset=(50, 10), log=lambda *a: None)
    assert plan.drawn == 4 and [(t["lr"], t["rank"]) for t in plan.trials] == [(1e-3, 4), (1e-3, 8), (1e-2, 4),
                                                                                (1e-2, 8)]
    assert plan.accountant == "rdp" and 0.99 * 3 <= plan.epsilon <= 3
    assert plan.epsilon == pytest.approx(tuning_epsilon(plan.noise_multiplier, 0.2, 2, 1e-3, count, 10.0, "rdp"))
    with pytest.raises(ConfigError, match="grid"):
        plan_tuning(_tiny(tmp_path), space, TrialCount.parse("fixed:3"), grid=True, dataset=(50, 10))


def test_dry_run_prints_the_noise_and_draws_nothing(tiny_bert_dir, tmp_path, capsys):
    from test_glue8 import make_fake_glue

    root = make_fake_glue(tmp_path / "glue", n_train=60, n_dev=12)
    out = tmp_path / "dry"
    assert main(["tune", "--model", tiny_bert_dir, "--task", "sst2", "--data", str(root), "--holdout-val", "10",
                 "--steps", "2", "--batch-size", "10", "--delta", "1e-3", "--epsilon", "3", "--accountant", "rdp",
                 "--lrs", "1e-3,1e-2", "--trials", "grid", "--output", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "grid of fixed:2 trials: per-trial noise multiplier" in printed and "drew" not in printed
    assert not out.exists()


def _fake_train(calls):
    def train(cfg, **kw):
        calls.append(cfg)
        folder = tmp = __import__("pathlib").Path(cfg.output)
        folder.mkdir(parents=True, exist_ok=True)
        acc = 0.5 + 0.3 * (cfg.lr == 1e-2) + (0.05 if cfg.method == "prism" else 0.0)
        (tmp / "summary.json").write_text(json.dumps({
            "steps": cfg.steps, "privacy": {"private": True, "epsilon": 1.0, "delta": cfg.delta},
            "eval": {"val": {"accuracy": acc, "n": 10}, "validation": {"accuracy": acc, "n": 12}}}))
    return train


def test_an_experiment_grid_tunes_honestly_with_tune_by_honest(tmp_path):
    """`tune: {by: honest, trials: grid}`: each (task, method, setting, seed) cell is a `prismdp tune` over the lr
    axis; the tables report the released trials with the whole tuning's epsilon; a second run trains nothing; bad
    honest settings are refused when the file is loaded."""
    from test_glue8 import make_fake_glue

    from prismdp.experiment import load_experiment, run_experiment

    root = make_fake_glue(tmp_path / "glue", n_train=60, n_dev=12)
    grid = {"name": "H", "output": str(tmp_path / "out"), "tasks": {"sst2": {}},
            "base": {"data": str(root), "holdout_val": 10, "steps": 2, "batch_size": 2, "delta": 1e-3,
                     "accountant": "rdp"},
            "methods": ["prism", "dp-adamw"], "privacy": [3], "seeds": [1, 2], "lrs": [1e-3, 1e-2],
            "tune": {"by": "honest", "trials": "geometric:2", "score_noise": 20.0}}
    calls = []
    run = run_experiment(load_experiment(grid), progress=False, log=lambda *a: None, train_fn=_fake_train(calls))
    assert not run.failures and len(run.ran) == 4
    drawn = {c: json.loads((tmp_path / "out" / c / "tune.json").read_text())["drawn"] for c in run.ran}
    assert len(calls) == sum(drawn.values())  # each cell trained the count it drew
    assert drawn["sst2__prism__eps3__seed1"] == drawn["sst2__dp-adamw__eps3__seed1"]  # paired: the seed's draw
    priv = json.loads((tmp_path / "out" / "sst2__prism__eps3__seed1" / "release" / "privacy.json").read_text())
    assert 0.99 * 3 <= priv["epsilon"] <= 3 and priv["trials"]["draw"] == "seeded generator (seed 1)"
    summary = json.loads((tmp_path / "out" / "sst2__prism__eps3__seed1" / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] == priv["epsilon"] and "val" not in summary["eval"]
    assert "sst2" in (tmp_path / "out" / "results.md").read_text()
    again = run_experiment(load_experiment(grid), progress=False, log=lambda *a: None, train_fn=_fake_train(calls))
    assert len(again.skipped) == 4 and len(calls) == sum(drawn.values())

    for tune, err in (({"by": "honest"}, "needs trials"), ({"by": "honest", "trials": "grid", "widen": 1}, "widen"),
                      ({"by": "honest", "trials": "fixed:x"}, "tune.trials"), ({"by": "val", "trials": "grid"},
                                                                                  "apply to by: honest")):
        with pytest.raises(ConfigError, match=err):
            load_experiment({**grid, "tune": tune})
    with pytest.raises(ConfigError, match="non-private"):
        load_experiment({**grid, "privacy": [3, "non-dp"]})


def test_the_score_noise_is_not_seeded_by_the_tune_seed(tmp_path):
    """The tune seed is published (privacy.json states it); the score noise must not follow from it."""
    from prismdp.experiment.honest import _score

    plan = plan_tuning(_tiny(tmp_path), Space((1e-3,)), TrialCount.parse("geometric:3"), tune_seed=5,
                       dataset=(50, 10), log=lambda *a: None)
    scores = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps({"eval": {"val": {"accuracy": 0.5, "n": 10}}}))
        scores.append(_score(plan, folder, 1))
    assert scores[0] != scores[1]


def test_a_fixed_count_past_the_step_cap_is_refused_before_any_accountant():
    """fixed:K composes K * steps steps: past MAX_STEPS (10^7) it is refused at once, like one run that long (Opacus'
    PRV asked for 1.5 TiB here before the check)."""
    with pytest.raises(ValueError, match="compose 20000000 steps"):
        tuning_epsilon(1.0, 0.01, 2, 1e-5, TrialCount.parse("fixed:10000000"), 10.0, "prv")
    with pytest.raises(ValueError, match="whole number of trials"):
        TrialCount.parse("fixed:inf")  # was an OverflowError (a traceback from the CLI)
