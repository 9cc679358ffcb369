"""`prismdp diagnose`: the measurement functions against the paper's closed forms, the probes against the
optimizers they instrument, and every diagnostic end to end on a tiny BERT."""

import math

import numpy as np
import pytest
import torch

from prismdp.cli import main
from prismdp.diagnostics import measures
from prismdp.diagnostics.cli import NAMES
from prismdp.diagnostics.table import read_csv

torch.set_num_threads(1)


def _unbalanced(m=24, n=16, r=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = 3.0 * torch.randn(m, r, generator=g, dtype=torch.float64)
    B = 0.2 * torch.randn(n, r, generator=g, dtype=torch.float64)
    return A, B


def test_lowrank_norms_equal_the_dense_matrices():
    A, B = _unbalanced()
    g = torch.Generator().manual_seed(1)
    xA, xB = torch.randn(A.shape, generator=g, dtype=A.dtype), torch.randn(B.shape, generator=g, dtype=B.dtype)
    eta = 0.3
    dense1 = xA @ B.T + A @ xB.T
    assert float(measures.first_order_sq(A, B, xA, xB)) == pytest.approx(float(dense1.square().sum()), rel=1e-10)
    assert float(measures.bilinear_sq(xA, xB, eta)) == pytest.approx(float((eta * xA @ xB.T).square().sum()), rel=1e-10)
    total = dense1 + eta * xA @ xB.T
    assert float(measures.factor_noise_sq(A, B, xA, xB, eta)) == pytest.approx(float(total.square().sum()), rel=1e-10)
    A1, B1 = A + 1e-6 * xA, B - 1e-6 * xB
    assert measures.delta_z_norm(A1, B1, A, B) == pytest.approx(float((A1 @ B1.T - A @ B.T).norm()), rel=1e-6)
    # the gauge leaves Z alone and moves the factor statistic as c^-2 / c^2
    Ac, Bc = measures.scalar_gauge(A, B, 4.0)
    assert measures.delta_z_norm(Ac, Bc, A, B) < 1e-12 * float((A @ B.T).norm())
    m, n = A.shape[0], B.shape[0]
    expected = m * float(B.square().sum()) / 16 + n * 16 * float(A.square().sum())
    assert measures.gauge_statistic(Ac, Bc) == pytest.approx(expected)
    assert measures.gram_stress(A) == pytest.approx(1 / float(torch.linalg.svdvals(A)[-1]))
    assert measures.gram_stress(torch.zeros(5, 2)) == math.inf


def test_summaries():
    v = np.array([[1.0, 5.0], [2.0, 1.0], [4.0, 3.0]])
    assert np.allclose(measures.range_index(v), [3.0, 4.0])
    b = measures.band(v)
    assert np.allclose(b.mean, [7 / 3, 3.0]) and np.allclose(b.min, [1, 1]) and np.allclose(b.max, [4, 5])
    assert np.allclose(measures.moving_average([1, 2, 3, 4, 5], 2), [1, 1.5, 2.5, 3.5, 4.5])
    assert np.allclose(measures.moving_average([2.0] * 30, 25), 2.0)


def test_gauge_sweep_obeys_the_closed_forms():
    """Monte-Carlo energies within 5 standard errors of Prop. amp / Thm. noise_energy at every c; the factor-space
    minimum at c* (Prop. scalar_range)."""
    A, B = _unbalanced()
    m, n, r = A.shape[0], B.shape[0], A.shape[1]
    tau, eta = 0.1, 0.05
    log10_c = np.linspace(-2, 2, 41)
    d = measures.gauge_sweep(A, B, tau, eta, log10_c, 64, torch.Generator().manual_seed(0))
    checks = {"prism": np.full(len(d.c), measures.prism_energy(m, n, r, tau)),
              "first": measures.factor_energy(A, B, tau, d.c),
              "bilinear": np.full(len(d.c), measures.bilinear_energy(m, n, r, tau, eta))}
    for key, theory in checks.items():
        mean, se = measures.mean_se(getattr(d, key))
        assert np.all(np.abs(mean - theory) < 5 * se), key
    cstar = measures.c_star(A, B)
    assert abs(math.log10(cstar)) > 0.5  # an unbalanced Z, so the check below is not trivially at c = 1
    step = log10_c[1] - log10_c[0]
    mean_first = d.first.mean(1)
    assert abs(log10_c[np.argmin(mean_first)] - math.log10(cstar)) <= 1.5 * step  # the nearest grid point +- 1
    assert measures.factor_energy(A, B, tau, cstar) == pytest.approx(
        2 * tau**2 * math.sqrt(m * n) * float(A.norm()) * float(B.norm()))


@pytest.fixture(scope="module")
def session(tiny_bert_dir):
    from prismdp.diagnostics.runs import Session
    from prismdp.diagnostics.settings import Settings

    s = Settings.from_dict(dict(model=tiny_bert_dir, synthetic_train=160, batch_size=16, rank=4, max_length=32,
                                progress=False))
    return Session(s, log=lambda *a: None)


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_probe_measures_without_changing_the_step(session, method):
    """A probed run ends exactly where an unprobed one (private.step()) does: the measured noise is the noise used."""
    from prismdp.lora import get_factors
    from prismdp.train.step import backward_batch

    probed = session.run(method, 3, 3, gauge=2.0)
    recs = probed.run_all()
    plain = session.run(method, 3, 3, gauge=2.0)
    plain.model.train()
    torch.manual_seed(3)
    data, pad_id = session.data, session.tokenizer.pad_token_id
    for batch in plain.private.batches():
        backward_batch(plain.private, plain.model, data.train, data.loss, batch, 32, pad_id)
        plain.private.step()
    for p1, p2 in zip(probed.private.pairs, plain.private.pairs):
        for x, y in zip(get_factors(p1), get_factors(p2)):
            assert torch.allclose(x, y, atol=1e-6, rtol=0)
    assert len(recs) == 3 and all(r.noise_sq > 0 and r.dz_norm > 0 and r.precond_noise_sq > 0 for r in recs)


def _rows(path):
    caption, rows = read_csv(path)
    assert len(caption) > 100
    return caption, rows


def _col(rows, key, **where):
    return np.array([float(r[key]) for r in rows if all(r[k] == v for k, v in where.items())])


def test_every_diagnostic_writes_a_figure_and_a_table_that_obey_the_theory(tiny_bert_dir, tmp_path, capsys):
    out = tmp_path / "diag"
    common = ["--model", tiny_bert_dir, "--synthetic-train", "160", "--batch-size", "16", "--rank", "4",
              "--max-length", "32", "--output", str(out), "--quiet"]
    extra = {"gauge-training": ["--steps", "4"], "gauge-sweep": ["--sweep-source", "random"],
             "noise-vs-S": ["--steps", "5"], "amplification": ["--steps", "6", "--window", "3"],
             "sigma-sweep": ["--steps", "5", "--burn-in", "1", "--epsilons", "2,8"]}
    for name in NAMES:
        assert main(["diagnose", name, *common, *extra[name]]) == 0, name
        png, csv = out / f"{name}.png", out / f"{name}.csv"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000, name
        assert csv.read_text().startswith("# caption: "), name
    assert "gauge-sweep" in capsys.readouterr().out

    # Issue I: PRISM re-balances any start, so its runs coincide for every c; DP-AdamW's do not
    caption, rows = _rows(out / "gauge-training.csv")
    assert "rho_t = max_c" in caption
    assert np.all(_col(rows, "rho_dz_relative", method="prism") < 1e-5)
    assert np.all(_col(rows, "rho_dz_relative", method="dp-adamw") > 1e-2)

    # Issue II, fixed Z: Monte-Carlo energies within 5 SE of the closed forms at every c; minimum near c*
    _, rows = _rows(out / "gauge-sweep.csv")
    assert len(rows) == 61
    for key in ("prism", "first"):
        mean, se, theory = (_col(rows, f"{key}_energy_{f}") for f in ("mean", "se", "theory"))
        assert np.all(np.abs(mean - theory) < 5 * se), key
    log10_c, first, theory = _col(rows, "log10_c"), _col(rows, "first_energy_mean"), _col(rows, "first_energy_theory")
    assert abs(log10_c[np.argmin(first)] - log10_c[np.argmin(theory)]) <= 0.1 + 1e-9
    assert abs(log10_c[np.argmin(theory)]) > 0.3  # the random Z is unbalanced

    # Issue II in training: E||N_Z||^2 = tau^2 S_t for DP-AdamW, tau^2 sum r(m+n-r) for PRISM
    _, rows = _rows(out / "noise-vs-S.csv")
    fac = [r for r in rows if r["method"] == "dp-adamw"]
    assert sum(float(r["noise_sq"]) for r in fac) / sum(float(r["tau2_S_t"]) for r in fac) == pytest.approx(1, abs=0.1)
    assert len({r["c"] for r in fac}) == 5
    pri = [r for r in rows if r["method"] == "prism"]
    level = [float(r["noise_sq"]) / float(r["prism_level_tau2_r(m+n-r)"]) for r in pri]
    assert np.mean(level) == pytest.approx(1, abs=0.1)

    _, rows = _rows(out / "amplification.csv")
    assert len(rows) == 6
    for key in rows[0]:
        if key not in ("seed", "step", "gram_stress_dp-adamw"):  # PEFT's A = 0 start: infinite stress at step 1
            assert np.all(np.isfinite(_col(rows, key))) and np.all(_col(rows, key) > 0), key

    _, rows = _rows(out / "sigma-sweep.csv")
    sig = {(r["method"], float(r["epsilon"])): float(r["sigma"]) for r in rows}
    assert sig["prism", 2.0] > sig["prism", 8.0] and sig["prism", 2.0] == sig["dp-adamw", 2.0]
    pri = [r for r in rows if r["method"] == "prism"]
    for r in pri:  # ||tau P(Xi)|| concentrates at tau sqrt(r(m+n-r)) summed over modules
        assert float(r["raw_noise_mean"]) == pytest.approx(float(r["raw_noise_theory"]), rel=0.05)


def test_diagnose_rejects_bad_settings(capsys):
    assert main(["diagnose", "gauge-sweep", "--gauges", "0,1", "--quiet"]) == 2
    assert "gauges" in capsys.readouterr().err


def test_diagnostics_put_lora_where_the_trainer_does(tiny_llama_dir, tmp_path):
    """The diagnostics' LoRA model comes from the trainer's build_lora_model: on a multimodal Gemma 3 the vision tower
    gets no LoRA (their own LoraConfig had lost exclude_modules and wrapped the tower's q/k/v)."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prismdp.diagnostics.runs import Session
    from prismdp.diagnostics.settings import Settings
    from test_experiment import _tiny_gemma3

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    torch.manual_seed(0)
    gemma_dir = tmp_path / "gemma3"
    AutoModelForCausalLM.from_config(_tiny_gemma3(len(tok), True)).save_pretrained(gemma_dir)
    tok.save_pretrained(gemma_dir)
    data = tmp_path / "train.json"
    data.write_text(json.dumps([{"instruction": f"add {i} and 1", "input": "", "output": f"{i + 1}"}
                                for i in range(8)]))
    s = Settings.from_dict(dict(model=str(gemma_dir), task="instruct", data=str(data), batch_size=4,
                                micro_batch_size=4, rank=4, max_length=64, progress=False))
    wrapped = [n for n, m in Session(s, log=lambda *a: None).peft_model(0).named_modules() if hasattr(m, "lora_A")]
    assert len(wrapped) == 5 * 2 and not any("vision" in n for n in wrapped)  # 5 kinds x 2 decoder layers
