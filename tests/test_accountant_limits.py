"""Issue 42, defects 2 and 6: where the default accountant (PRV) cannot answer fast or accurately, the answer comes at
once (``inf`` with its reason) or from PLD, and the switch is said (``prismdp epsilon``'s stderr, ``privacy.json``).

A guard on Opacus' PRV discretisation fails any PRV grid above 2e6 points (prismdp's cap is 1e6), so the tests fail
on the old code without allocating its gigabytes."""

import math

import pytest

from prismdp.cli import main
from prismdp.privacy import PrivacyBudget, calibrate_sigma, epsilon
from prismdp.privacy.accounting import accounting_note
from prismdp.privacy.lower_bound import epsilon_lower_bound


@pytest.fixture
def no_big_prv_grid(monkeypatch):
    import opacus.accountants.prv as opacus_prv

    real = opacus_prv.discretize

    def bounded(tprv, domain):
        assert domain.size <= 2_000_000, f"a PRV grid of {domain.size:.3g} points"
        return real(tprv, domain)

    monkeypatch.setattr(opacus_prv, "discretize", bounded)


def test_a_tiny_sigma_is_answered_inf_at_once_with_its_reason(no_big_prv_grid, capsys):
    """Defect 2: `prismdp epsilon --sigma 0.01 --sample-rate 0.0064 --steps 300 --delta 1e-5` (the default PRV) ended in
    a traceback after trying to allocate 136 GiB.  Now a distinguishing test's lower bound proves epsilon above 100
    before any accountant runs: inf, one stderr line with the reason."""
    rc = main(["epsilon", "--sigma", "0.01", "--sample-rate", "0.0064", "--steps", "300", "--delta", "1e-5"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip() == "inf", (out, err)
    assert err.count("\n") == 1 and "above 100" in err and "lower bound" in err, err


def test_prv_past_its_grid_cap_is_answered_by_pld_and_says_so(no_big_prv_grid):
    """Defect 6: at long horizons PRV's grid grows with sqrt(steps) (48 s at a million steps, q 0.0064, sigma 1.1).
    At 1e5 steps it would need ~4e6 points: PLD answers instead, and the note names it and why."""
    args = (1.1, 0.0064, 100_000, 1e-5)
    assert epsilon(*args) == epsilon(*args, accountant="pld")
    note = accounting_note(*args)
    assert note.startswith("answered by the pld accountant") and "points" in note, note
    assert accounting_note(*args, accountant="pld") is None and accounting_note(1.1, 0.0064, 300, 1e-5) is None


def test_where_prv_cannot_answer_the_smaller_of_pld_and_rdp_answers(no_big_prv_grid):
    """Found by tests/test_privacy_properties.py in CI: PRV's stand-in was PLD alone, whose pessimistic rounding can
    add up to ``steps x interval`` (1e-4): at sigma 1697, q 0.147, 9.8e6 steps, delta 1e-11 the default accountant
    reported 23.3 where RDP certifies 1.79.  Both are upper bounds, so the smaller one answers.  Here (1.8 s) PLD
    gives 7.01 and RDP 1.96; Opacus' RDP accountant is called directly as the independent value."""
    from opacus.accountants import RDPAccountant

    args = (1697.0, 0.5, 10**6, 1e-11)
    rdp = RDPAccountant()
    rdp.history = [(args[0], args[1], args[2])]
    independent = rdp.get_epsilon(args[3])
    assert epsilon(*args, accountant="pld") > 3 * independent  # the regime the rule is for
    assert epsilon(*args) == pytest.approx(independent, rel=1e-9)
    assert accounting_note(*args).startswith("answered by the rdp accountant"), accounting_note(*args)
    assert epsilon(*args) >= epsilon_lower_bound(*args)


def test_a_target_at_prvs_error_floor_is_calibrated_by_pld_and_says_so(capsys):
    """Defect 6: `--target-epsilon 0.01` returned sigma 256 (PRV's additive error 0.01 is its whole answer there; PLD
    needs 27.6), silently.  Now PLD answers below epsilon 0.1 and the line says so; the budget's report (privacy.json)
    records the same note."""
    sigma = calibrate_sigma(0.01, 1e-5, 0.0064, 300)
    assert sigma == calibrate_sigma(0.01, 1e-5, 0.0064, 300, accountant="pld") and sigma < 30, sigma
    assert main(["epsilon", "--target-epsilon", "0.01", "--sample-rate", "0.0064", "--steps", "300"]) == 0
    out, err = capsys.readouterr()
    assert float(out) == pytest.approx(sigma, rel=1e-6) and "answered by the pld accountant" in err, err
    budget = PrivacyBudget(sigma, 0.0064, 1e-5, target_epsilon=0.01)
    budget.spend(300)
    rep = budget.report()
    assert rep["accountant"] == "prv" and rep["accountant_note"].startswith("answered by the pld accountant"), rep
    assert rep["epsilon"] <= 0.01


def test_steps_beyond_the_tested_range_are_refused():
    with pytest.raises(ValueError, match="above 1e\\+07"):
        epsilon(1.0, 0.01, 10**8, 1e-5)
    assert math.isinf(epsilon(1.0, 0.0064, 10**7, 1e-5))  # the lower bound proves it above 100: no accountant call
