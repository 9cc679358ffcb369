"""Tests for prismdp.eval.metrics (GLUE metrics) and prismdp.eval.answers (answer extraction).

Reference implementations (sklearn.metrics, scipy.stats) are test-only dependencies.  Tests that read the
shared data in /work/shared/data skip when it is absent.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from prismdp.data.tasks import GLUE8_TASKS, GLUE_EVAL_SETS
from prismdp.eval.answers import (
    DEFAULT_AQUA_RULE,
    extract_choice,
    extract_number,
    is_correct,
    math_accuracy,
    parse_glue_label,
    parse_glue_labels,
)
from prismdp.eval.metrics import (
    accuracy,
    f1_binary,
    glue8_scores,
    glue_metrics,
    main_score,
    matthews_corrcoef,
    mnli_score,
    pearson,
    rankdata,
    spearman,
)

DATA = Path("/work/shared/data")
MATH = DATA / "math"
NUMERIC_SETS = ("gsm8k", "mawps", "svamp")
SEEDS = range(8)


def _load_math(name: str) -> list[dict]:
    path = MATH / f"{name}_test.json"
    if not path.is_file():
        pytest.skip(f"shared data not available: {path}")
    with path.open(encoding="utf-8") as fh:
        return json.load(fh)


# ========================================================================================================
# metrics: hand-computed values
# ========================================================================================================
def test_accuracy_by_hand():
    assert accuracy([0, 1, 1, 0], [0, 1, 0, 0]) == 0.75
    assert accuracy(["a", "b"], ["a", "b"]) == 1.0
    assert accuracy([1], [0]) == 0.0


def test_mcc_by_hand():
    # TP=2 TN=2 FP=1 FN=1 -> (4 - 1) / sqrt(3^4) = 1/3
    assert matthews_corrcoef([1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 1]) == pytest.approx(1 / 3)
    # TP=2 TN=1 FP=0 FN=1 -> 2 / sqrt(2 * 3 * 1 * 2)
    assert matthews_corrcoef([1, 0, 1, 1], [1, 0, 0, 1]) == pytest.approx(2 / math.sqrt(12))
    assert matthews_corrcoef([0, 1, 0, 1], [0, 1, 0, 1]) == pytest.approx(1.0)
    assert matthews_corrcoef([0, 1, 0, 1], [1, 0, 1, 0]) == pytest.approx(-1.0)


def test_mcc_undefined_is_zero():
    assert matthews_corrcoef([0, 1, 1, 0], [1, 1, 1, 1]) == 0.0  # constant prediction
    assert matthews_corrcoef([1, 1, 1], [0, 1, 0]) == 0.0  # constant truth
    assert matthews_corrcoef([1, 1], [1, 1]) == 0.0


def test_f1_by_hand():
    # positive=1: TP=1 FP=1 FN=0 -> 2/3 ; positive=0: TP=2 FP=0 FN=1 -> 4/5
    assert f1_binary([1, 0, 0, 0], [1, 1, 0, 0]) == pytest.approx(2 / 3)
    assert f1_binary([1, 0, 0, 0], [1, 1, 0, 0], positive=0) == pytest.approx(0.8)
    assert f1_binary([0, 0], [0, 0]) == 0.0  # no true and no predicted positive
    assert f1_binary([1, 1], [0, 0]) == 0.0
    assert f1_binary(["dup", "x"], ["dup", "dup"], positive="dup") == pytest.approx(2 / 3)


def test_pearson_by_hand():
    # xc = [-1, 0, 1], yc = [-4/3, -1/3, 5/3] -> 3 / (sqrt(2) * sqrt(42) / 3) = 9 / sqrt(84)
    assert pearson([1, 2, 3], [1, 2, 4]) == pytest.approx(9 / math.sqrt(84))
    assert pearson([1, 2, 3], [6, 4, 2]) == pytest.approx(-1.0)
    assert pearson([1, 2, 3], [2.5, 2.5, 2.5]) == 0.0  # constant input: 0.0 by convention (scipy: nan)


def test_spearman_by_hand_with_ties():
    assert rankdata([10, 20, 20, 5]).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert rankdata([3, 3, 3]).tolist() == [2.0, 2.0, 2.0]
    # ranks x = [1, 2.5, 2.5, 4], ranks y = [1, 3, 2, 4] -> 4.5 / sqrt(4.5 * 5) = sqrt(0.9)
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(math.sqrt(0.9))
    assert spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)  # monotone, non-linear
    assert spearman([1, 1, 1], [1, 2, 3]) == 0.0


@pytest.mark.parametrize("fn", [accuracy, f1_binary, matthews_corrcoef, pearson, spearman])
def test_metric_input_validation(fn):
    with pytest.raises(ValueError, match="empty"):
        fn([], [])
    with pytest.raises(ValueError, match="length mismatch"):
        fn([0, 1, 1], [0, 1])
    with pytest.raises(ValueError):
        fn([[0, 1]], [[0, 1]])


def test_metric_rejects_mixed_label_types_and_nonfinite():
    with pytest.raises(ValueError, match="label types"):
        accuracy(["1", "0"], [1, 0])
    with pytest.raises(ValueError):
        pearson([1.0, float("nan")], [1.0, 2.0])
    with pytest.raises(ValueError):
        spearman([1.0, 2.0], [float("inf"), 2.0])


# ========================================================================================================
# metrics: against sklearn / scipy on random inputs
# ========================================================================================================
@pytest.mark.parametrize("seed", SEEDS)
def test_classification_metrics_match_sklearn(seed):
    skm = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 400))
    p_pos = rng.uniform(0.05, 0.95)
    y_true = (rng.random(n) < p_pos).astype(int)
    flip = rng.random(n) < rng.uniform(0.0, 0.6)
    y_pred = np.where(flip, 1 - y_true, y_true)
    assert accuracy(y_true, y_pred) == pytest.approx(skm.accuracy_score(y_true, y_pred), abs=1e-12)
    assert matthews_corrcoef(y_true, y_pred) == pytest.approx(skm.matthews_corrcoef(y_true, y_pred), abs=1e-12)
    for pos in (0, 1):
        ref = skm.f1_score(y_true, y_pred, pos_label=pos, zero_division=0.0)
        assert f1_binary(y_true, y_pred, positive=pos) == pytest.approx(ref, abs=1e-12)
    # lists of Python ints behave like arrays
    assert matthews_corrcoef(y_true.tolist(), y_pred.tolist()) == pytest.approx(
        skm.matthews_corrcoef(y_true, y_pred), abs=1e-12
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_multiclass_mcc_and_degenerate_cases_match_sklearn(seed):
    skm = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(3, 200))
    y_true = rng.integers(0, 3, n)
    y_pred = rng.integers(0, 3, n)
    assert matthews_corrcoef(y_true, y_pred) == pytest.approx(skm.matthews_corrcoef(y_true, y_pred), abs=1e-12)
    const = np.full(n, int(rng.integers(0, 2)))
    assert matthews_corrcoef(y_true % 2, const) == skm.matthews_corrcoef(y_true % 2, const) == 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_correlations_match_scipy(seed):
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(200 + seed)
    n = int(rng.integers(3, 500))
    x = rng.uniform(0, 5, n)
    y = x + rng.normal(0, rng.uniform(0.1, 3.0), n)
    assert pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-10)
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-10)
    # heavy ties (STS-B gold is on a 0.2 grid; parsed predictions are often integers)
    xt = np.round(x * 5) / 5
    yt = np.clip(np.round(y), 0, 5)
    if np.ptp(xt) > 0 and np.ptp(yt) > 0:
        assert spearman(xt, yt) == pytest.approx(stats.spearmanr(xt, yt)[0], abs=1e-10)
        assert pearson(xt, yt) == pytest.approx(stats.pearsonr(xt, yt)[0], abs=1e-10)
    ints = rng.integers(0, 4, n)
    assert rankdata(ints) == pytest.approx(stats.rankdata(ints))


# ========================================================================================================
# GLUE task mapping and the Table-2 score
# ========================================================================================================
def test_glue_metrics_keys():
    y = [0, 1, 1, 0]
    p = [0, 1, 0, 0]
    assert set(glue_metrics("cola", y, p)) == {"mcc"}
    for task in ("sst2", "mnli_matched", "mnli_mismatched", "qnli", "rte"):
        assert glue_metrics(task, y, p) == {"accuracy": 0.75}
    for task in ("mrpc", "qqp"):
        m = glue_metrics(task, y, p)
        assert m == pytest.approx({"f1": 2 / 3, "accuracy": 0.75})  # TP=1 FP=0 FN=1
    m = glue_metrics("stsb", [0.0, 1.0, 2.0], [0.0, 1.0, 4.0])
    assert set(m) == {"pearson", "spearman"} and m["spearman"] == pytest.approx(1.0)
    assert set(GLUE_EVAL_SETS) == {"cola", "sst2", "mrpc", "stsb", "qqp", "mnli_matched", "mnli_mismatched", "qnli",
                                   "rte"}
    assert glue_metrics(" CoLA ", y, p) == glue_metrics("cola", y, p)


def test_glue_metrics_errors():
    with pytest.raises(ValueError) as exc:
        glue_metrics("wnli", [0], [0])
    for name in GLUE_EVAL_SETS:
        assert name in str(exc.value)
    with pytest.raises(ValueError):
        main_score("mnli", {"accuracy": 0.5})  # the combined column is mnli_score
    with pytest.raises(ValueError, match="empty"):
        glue_metrics("sst2", [], [])
    with pytest.raises(ValueError, match="length"):
        glue_metrics("sst2", [0, 1], [0])
    with pytest.raises(ValueError, match="None"):
        glue_metrics("rte", [0, 1], [0, None])
    with pytest.raises(ValueError, match="lack"):
        main_score("mrpc", {"accuracy": 0.5})


def test_main_score_conventions():
    assert main_score("cola", {"mcc": 0.4}) == 0.4
    assert main_score("sst2", {"accuracy": 0.9}) == 0.9
    assert main_score("mrpc", {"f1": 0.8, "accuracy": 0.7}) == pytest.approx(0.75)
    assert main_score("qqp", {"f1": 0.6, "accuracy": 0.8}) == pytest.approx(0.7)
    assert main_score("stsb", {"pearson": 0.7, "spearman": 0.5}) == pytest.approx(0.6)
    assert mnli_score({"accuracy": 0.8}, {"accuracy": 0.7}) == pytest.approx(0.75)


def test_glue8_scores_row():
    per_task = {
        "cola": {"mcc": 0.4},
        "sst2": {"accuracy": 0.9},
        "mrpc": {"f1": 0.8, "accuracy": 0.7},
        "stsb": {"pearson": 0.7, "spearman": 0.5},
        "qqp": {"f1": 0.6, "accuracy": 0.8},
        "mnli_matched": {"accuracy": 0.8},
        "mnli_mismatched": {"accuracy": 0.7},
        "qnli": {"accuracy": 0.85},
        "rte": {"accuracy": 0.75},
    }
    row = glue8_scores(per_task)
    expected = {"cola": 0.4, "sst2": 0.9, "mrpc": 0.75, "stsb": 0.6, "qqp": 0.7, "mnli": 0.75, "qnli": 0.85, "rte": 0.75}
    assert tuple(c for c in row if c != "avg") == GLUE8_TASKS
    assert {k: row[k] for k in expected} == pytest.approx(expected)
    assert row["avg"] == pytest.approx(sum(expected.values()) / 8)
    del per_task["qqp"]
    with pytest.raises(ValueError, match="qqp"):
        glue8_scores(per_task)


def _read_tsv(path: Path, header: bool) -> list[list[str]]:
    if not path.is_file():
        pytest.skip(f"shared data not available: {path}")
    with path.open(encoding="utf-8-sig", newline="") as fh:
        rows = list(csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    return rows[1:] if header else rows


def test_glue_metrics_on_real_dev_labels():
    skm = pytest.importorskip("sklearn.metrics")
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(7)
    cola = np.array([int(r[1]) for r in _read_tsv(DATA / "glue/CoLA/dev.tsv", header=False)])
    assert cola.shape == (1043,)
    pred = np.where(rng.random(cola.size) < 0.3, 1 - cola, cola)
    assert glue_metrics("cola", cola, pred)["mcc"] == pytest.approx(skm.matthews_corrcoef(cola, pred), abs=1e-12)
    assert glue_metrics("cola", cola, cola)["mcc"] == pytest.approx(1.0)
    mrpc = np.array([int(r[0]) for r in _read_tsv(DATA / "glue/MRPC/dev.tsv", header=True)])
    assert mrpc.shape == (408,)
    pred = np.where(rng.random(mrpc.size) < 0.25, 1 - mrpc, mrpc)
    m = glue_metrics("mrpc", mrpc, pred)
    assert m["f1"] == pytest.approx(skm.f1_score(mrpc, pred), abs=1e-12)
    assert m["accuracy"] == pytest.approx(skm.accuracy_score(mrpc, pred), abs=1e-12)
    stsb = np.array([float(r[9]) for r in _read_tsv(DATA / "glue/STS-B/dev.tsv", header=True)])
    assert stsb.shape == (1500,)
    pred = np.clip(np.round(stsb + rng.normal(0, 1.0, stsb.size)), 0, 5)  # integer answers: many ties
    m = glue_metrics("stsb", stsb, pred)
    assert m["pearson"] == pytest.approx(stats.pearsonr(stsb, pred)[0], abs=1e-10)
    assert m["spearman"] == pytest.approx(stats.spearmanr(stsb, pred)[0], abs=1e-10)


# ========================================================================================================
# math answers: synthetic cases
# ========================================================================================================
def test_extract_number_cases():
    assert extract_number("The answer is 576.") == 576.0
    assert extract_number("She has 1,234 apples and pays $1,234,567.89.") == 1234567.89
    assert extract_number("The difference is -8 - (-7) = -1") == -1.0
    assert extract_number("x = 0.75") == 0.75
    assert extract_number("3 apples, then 5 pears, so 8") == 8.0
    assert extract_number("no digits here") is None
    assert extract_number("") is None
    assert extract_number(None) is None
    # LLM-Adapters quirks kept for protocol fidelity
    assert extract_number("10-3") == -3.0
    assert extract_number("3,4") == 34.0


def test_is_correct_tolerance_and_errors():
    assert is_correct("gsm8k", "so 16", "16.0")
    assert is_correct("GSM8K", "so 16.0005", "16.0")  # |diff| <= 1e-3
    assert not is_correct("gsm8k", "so 16.01", "16.0")
    assert is_correct("mawps", "about 1.8333", "1.8333333333333335")
    assert not is_correct("mawps", "about 1.83", "1.8333333333333335")
    assert not is_correct("svamp", "", "3.0")
    assert is_correct("SVAMP", "It is -15.", "-15.0")
    with pytest.raises(ValueError, match="gsm8k"):
        is_correct("math401", "1", "1")
    with pytest.raises(ValueError):
        is_correct("gsm8k", "1", "one")
    with pytest.raises(ValueError):
        is_correct("aqua", "A", "F")


def test_extract_choice_rules():
    # the default is upstream LLM-Adapters' evaluate.py (extract_answer_letter): the FIRST capital A-E, so
    # "Answer" contributes the A
    assert DEFAULT_AQUA_RULE == "first"
    assert extract_choice("Answer: (C)") == "A" == extract_choice("Answer: (C)", rule="first")
    assert extract_choice("The answer is (C).") == "C"
    assert extract_choice("The answer is (C).", rule="last") == "C"
    assert extract_choice("Answer: (C)", rule="last") == "C"
    assert extract_choice("the answer is c", rule="last") is None  # 'last' is case-sensitive
    assert extract_choice("") is None and extract_choice(None) is None
    assert extract_choice("(B) because Each...", rule="last") == "E"
    assert extract_choice("(B) because Each...", rule="prism") == "B"  # last standalone letter
    assert extract_choice("the answer is c", rule="prism") == "C"
    with pytest.raises(ValueError):
        extract_choice("A", rule="middle")


def test_math_accuracy_counts_unparsed():
    out = math_accuracy("gsm8k", ["The answer is 3.", "no idea", "4"], ["3.0", "5.0", "5.0"])
    assert out == {"accuracy": pytest.approx(1 / 3), "n": 3, "correct": 1, "unparsed": 1}
    out = math_accuracy("AQuA", ["(A)", "(B)", "none"], ["A", "C", "D"])
    assert out["correct"] == 1 and out["unparsed"] == 1 and out["n"] == 3
    with pytest.raises(ValueError, match="empty"):
        math_accuracy("gsm8k", [], [])
    with pytest.raises(ValueError, match="length"):
        math_accuracy("gsm8k", ["1"], ["1", "2"])


# ========================================================================================================
# math answers: real records (the `output` field is an archived model response, not gold; `answer` is gold)
# ========================================================================================================
# (dataset, index, expected number extracted from `output`, correct against `answer`?) -- read by hand
HAND_NUMERIC = [
    ("gsm8k", 0, 576.0, True),  # "... The answer is 576."  gold 576.0
    ("gsm8k", 1, 60.0, False),  # "... The answer is 60."  gold 120.0
    ("gsm8k", 3, 16.0, True),  # "The answer is 16 hours."
    ("gsm8k", 4, 12.0, False),  # gold 11.0
    ("gsm8k", 7, 4.0, False),  # truncated "... removes 4 liters of water per day. "  gold 29.0
    ("gsm8k", 8, 70.0, True),  # "The answer is $70."
    ("gsm8k", 27, 200.0, False),  # "$3,350 - $3,150 = $200. The answer is $200."  gold 100.0
    ("gsm8k", 29, 66.67, False),  # "The answer is 66.67."  gold 70.0
    ("gsm8k", 46, 21600.0, False),  # "The answer is 21,600."  gold 43200.0
    ("svamp", 0, 32.0, False),  # gold 8.0
    ("svamp", 1, 333.0, True),
    ("svamp", 19, -1.0, False),  # "The answer is -1."  gold 1.0
    ("svamp", 40, 94.0, False),  # "43 - (-51) = 94. The answer is 94."  gold 112.0
    ("svamp", 47, 2.5, False),  # "The answer is 2.5 days."  gold 1.0
]


@pytest.mark.parametrize("dataset,index,expected,correct", HAND_NUMERIC)
def test_numeric_real_records(dataset, index, expected, correct):
    rec = _load_math(dataset)[index]
    assert extract_number(rec["output"]) == pytest.approx(expected)
    assert is_correct(dataset, rec["output"], rec["answer"]) is correct


def test_mawps_archived_outputs_are_empty_and_unparsed():
    recs = _load_math("mawps")[:50]
    assert recs[0]["answer"] == "1.8333333333333335" and recs[1]["answer"] == "-15.0"
    assert all(r["output"] == "" for r in recs)
    out = math_accuracy("mawps", [r["output"] for r in recs], [r["answer"] for r in recs])
    assert out == {"accuracy": 0.0, "n": 50, "correct": 0, "unparsed": 50}


# (index, gold, expected letter under rules last / first / prism) -- read by hand
HAND_AQUA = [
    (0, "A", "D", "D", "D"),  # "...$1.23.The answer is (D)."
    (1, "C", "C", "C", "C"),
    (2, "D", "C", "C", "C"),
    (5, "D", "D", "B", "D"),  # "Bill's average speed ... The answer is (D)."  first rule reads the B of Bill
    (12, "B", "B", "C", "B"),  # "Cost of manufacturing ..." -> first rule reads C
    (16, "A", "A", "C", "A"),  # "10C2 = ..."
    (17, "D", "A", "D", "A"),  # "... men is D. ... The answer is (A)."  first rule is right by accident
    (59, "D", None, None, "E"),  # "Rationale: Let the marked price of the watch be x."  (truncated, no answer)
]


@pytest.mark.parametrize("index,gold,last,first,prism", HAND_AQUA)
def test_aqua_real_records(index, gold, last, first, prism):
    rec = _load_math("aqua")[index]
    assert rec["answer"] == gold
    assert extract_choice(rec["output"], rule="last") == last
    assert extract_choice(rec["output"]) == first == extract_choice(rec["output"], rule="first")
    assert extract_choice(rec["output"], rule="prism") == prism
    assert is_correct("aqua", rec["output"], gold, aqua_rule="last") is (last == gold)
    assert is_correct("aqua", rec["output"], gold) is (first == gold)


def test_aqua_rule_disagreement_counts_documented():
    recs = _load_math("aqua")
    outs = [r["output"] for r in recs]
    last = [extract_choice(o, rule="last") for o in outs]
    assert sum(a != extract_choice(o, rule="first") for a, o in zip(last, outs)) == 48
    assert sum(a != extract_choice(o, rule="prism") for a, o in zip(last, outs)) == 1


@pytest.mark.parametrize("dataset", NUMERIC_SETS)
def test_every_numeric_gold_round_trips(dataset):
    recs = _load_math(dataset)
    golds = [r["answer"] for r in recs]
    for gold in golds:
        value = float(gold)
        assert is_correct(dataset, "The answer is " + gold, gold), gold
        assert is_correct(dataset, f"So the total is {value:,}.", gold), gold  # thousands separators
        assert is_correct(dataset, f"{gold}\n", gold), gold
        assert not is_correct(dataset, f"The answer is {value + 1}", gold), gold
    out = math_accuracy(dataset, ["The answer is " + g for g in golds], golds)
    assert out == {"accuracy": 1.0, "n": len(recs), "correct": len(recs), "unparsed": 0}


def test_every_aqua_gold_round_trips():
    golds = [r["answer"] for r in _load_math("aqua")]
    assert set(golds) <= set("ABCDE")
    for gold in golds:
        for text in (f"The answer is {gold}", f"The answer is ({gold}).", f"({gold})", gold, f" {gold}.\n",
                     f"Answer: ({gold})"):
            for rule in ("last", "prism"):
                assert is_correct("aqua", text, gold, aqua_rule=rule), (text, rule)
            assert is_correct("aqua", text.lower(), gold, aqua_rule="prism")
        wrong = "ABCDE"[("ABCDE".index(gold) + 1) % 5]
        assert not is_correct("aqua", f"The answer is ({wrong}).", gold)
        # upstream first-letter rule: "Answer: (X)" is read as A
        assert is_correct("aqua", f"Answer: ({gold})", gold, aqua_rule="first") is (gold == "A")
    out = math_accuracy("aqua", [f"The answer is ({g})." for g in golds], golds)
    assert out["accuracy"] == 1.0 and out["unparsed"] == 0


# ========================================================================================================
# GLUE label parser
# ========================================================================================================
@pytest.mark.parametrize(
    "task,text,expected",
    [
        ("rte", "not_entailment", 1),
        ("rte", "Entailment.", 0),
        ("rte", "  entailment  ", 0),
        ("rte", "NOT ENTAILMENT", 1),
        ("rte", "not-entailment", 1),
        ("rte", "Answer: not_entailment</s>", 1),
        ("qnli", "not_entailment\n\n### Instruction: entailment", 1),
        ("qnli", "entailment\nnot_entailment", 0),  # first label wins
        ("cola", "unacceptable", 0),
        ("cola", "Acceptable", 1),
        ("cola", "The sentence is not acceptable.", 0),
        ("cola", "un-acceptable", 0),
        ("sst2", "The answer is: negative", 0),
        ("sst2", "Positive!", 1),
        ("sst2", '"negative"', 0),
        ("sst2", "not positive", None),  # a negated non-label is not read as either label
        ("sst2", "positively", None),  # whole words only
        ("mrpc", "not_equivalent", 0),
        ("mrpc", "Equivalent", 1),
        ("mrpc", " Not equivalent. ", 0),
        ("qqp", "not_duplicate", 0),
        ("qqp", "duplicate", 1),
        ("qqp", "nonduplicate", None),
        ("mnli", "entailment", 0),
        ("mnli", "Neutral.", 1),
        ("mnli", "CONTRADICTION", 2),
        ("mnli", "not_entailment", None),  # not an MNLI label; must not read as entailment
        ("mnli", "not entailment, contradiction", 2),
        ("mnli_matched", "neutral", 1),
        ("rte", "yes", None),
        ("sst2", "", None),
        ("sst2", None, None),
        ("cola", "The answer is", None),
        ("stsb", "3.8", 3.8),
        ("stsb", " Score: 4 out of 5", 4.0),
        ("stsb", "7.5", 5.0),
        ("stsb", "-1", 0.0),
        ("stsb", ".5", 0.5),
        ("stsb", "similar", None),
    ],
)
def test_parse_glue_label(task, text, expected):
    got = parse_glue_label(task, text)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected)
        assert type(got) is type(expected)


def test_parse_glue_label_all_label_words_round_trip():
    labelled = {name: t.label_names for name, (t, _) in GLUE_EVAL_SETS.items() if t.label_names}
    labelled["mnli"] = labelled["mnli_matched"]  # a task is parsed by its name or by one of its eval sets
    assert len(labelled) == 9
    for task, labels in labelled.items():
        for idx, word in enumerate(labels):
            for text in (word, word.upper(), f" {word.capitalize()}.", f"Label: {word}\n", f"'{word}'"):
                assert parse_glue_label(task, text) == idx, (task, text)
    assert parse_glue_labels("rte", ["entailment", "not_entailment", "?"]) == [0, 1, None]
    with pytest.raises(ValueError, match="cola"):
        parse_glue_label("wnli", "entailment")
