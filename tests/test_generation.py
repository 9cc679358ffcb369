"""Generation-based evaluation (GLUE8 labels, Math-10K answers) on a tiny random Llama: batching, bookkeeping."""

import json

import pytest
import torch

from prismdp.eval.answers import extract_choice, extract_number
from prismdp.data.tasks import expand_eval_tasks
from prismdp.eval.decoding import generate
from prismdp.eval.generation import run_eval_sets
from prismdp.eval.scoring import evaluate_glue_generation, evaluate_math_generation
from prismdp.eval.sets import resolve_eval_sets
from prismdp.experiment.columns import table_scores
from prismdp.models import load_model
from prismdp.train.config import ConfigError, TrainConfig
from prismdp.train.loop import train
from test_glue8 import make_fake_glue

torch.set_num_threads(1)
QUIET = dict(progress=False, log=lambda *a: None)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_model(tiny_llama_dir, "causal_lm")


def make_math_dir(root, n=5):
    root.mkdir(parents=True, exist_ok=True)
    for name, answers in (("gsm8k", [str(float(i)) for i in range(n)]), ("aqua", ["A", "B", "C", "D", "E"][:n])):
        recs = [{"instruction": f"Question {i}: what is {i} + 0?", "input": "", "output": "not gold 999",
                 "answer": a} for i, a in enumerate(answers)]
        (root / f"{name}_test.json").write_text(json.dumps(recs, indent=4))
    return root


def test_batched_left_padded_greedy_equals_one_by_one(llama):
    model, tok = llama
    prompts = ["Hello there, how are", "A", "The quick brown fox jumps over the lazy dog and then", "1 2 3", "x y"]
    g = generate(model, tok, prompts, batch_size=3, max_new_tokens=5)
    assert len(g.texts) == len(g.finished) == len(g.prompt_tokens) == len(prompts)
    singles = [generate(model, tok, [p], batch_size=1, max_new_tokens=5).texts[0] for p in prompts]
    assert g.texts == singles
    assert model.training is False


def test_glue_scoring_counts_unparsed_as_wrong():
    gens = ["entailment", "not_entailment.", "I think so", "", "Entailment!"]
    gold = [0, 1, 0, 1, 1]
    res = evaluate_glue_generation("rte", gens, gold)
    assert res["n"] == 5 and res["unparsed"] == 2 and res["parse_rate"] == pytest.approx(0.6)
    assert res["accuracy"] == pytest.approx(2 / 5) and res["score"] == res["accuracy"]
    assert res["predictions"] == [0, 1, None, None, 0]
    # the authors' fallback (label 0) makes the unparsed gold-0 example right by chance
    assert evaluate_glue_generation("rte", gens, gold, unparsed="fallback")["accuracy"] == pytest.approx(3 / 5)
    # MRPC: an unparsed gold-negative must not count as a true negative for F1 either
    f1 = evaluate_glue_generation("mrpc", ["equivalent", "???"], [1, 0])
    assert f1["f1"] == pytest.approx(2 / 3) and f1["accuracy"] == 0.5
    st = evaluate_glue_generation("stsb", ["4.5", "no idea", "1.0", "0.5"], [4.4, 4.0, 1.2, 0.4])
    assert st["unparsed"] == 1 and "pearson" in st and st["score"] < 1.0
    mm = evaluate_glue_generation("mnli", ["neutral", "contradiction"], [1, 0], metric_task="mnli_mismatched")
    assert mm["accuracy"] == 0.5


def test_one_aqua_rule_default():
    """The AQuA letter rule defaults to upstream LLM-Adapters' (first capital A-E) everywhere: the answer functions,
    the scorer and TrainConfig (whose field is declared without importing eval, so it is compared here)."""
    import dataclasses
    import inspect

    from prismdp.eval.answers import AQUA_RULES, DEFAULT_AQUA_RULE, extract_answer, is_correct, math_accuracy

    assert DEFAULT_AQUA_RULE == "first"
    field = {f.name: f for f in dataclasses.fields(TrainConfig)}["aqua_rule"]
    assert field.default == DEFAULT_AQUA_RULE and tuple(field.metadata["choices"]) == AQUA_RULES
    for fn, arg in ((extract_choice, "rule"), (extract_answer, "aqua_rule"), (is_correct, "aqua_rule"),
                    (math_accuracy, "aqua_rule"), (evaluate_math_generation, "aqua_rule"), (run_eval_sets, "aqua_rule")):
        assert inspect.signature(fn).parameters[arg].default == DEFAULT_AQUA_RULE, fn.__name__


def test_math_scoring_uses_gold_answer_and_records_aqua_rule():
    res = evaluate_math_generation("aqua", ["Answer: (C) because", "nothing", "B"], ["C", "A", "B"])
    assert res["aqua_rule"] == "first" and res["unparsed"] == 1
    assert res["correct"] == 1  # first capital A-E of "Answer: (C)" is the A of "Answer" (upstream rule)
    assert res["predictions"] == ["A", None, "B"]
    assert evaluate_math_generation("aqua", ["Answer: (C) because"], ["C"], aqua_rule="last")["correct"] == 1
    gsm = evaluate_math_generation("gsm8k", ["so 1,234 apples", "x"], ["1234.0", "1"])
    assert gsm["accuracy"] == 0.5 and gsm["predictions"] == [1234.0, None]


def test_eval_set_names_and_missing_files(tmp_path):
    assert expand_eval_tasks("math") == ["gsm8k", "aqua", "mawps", "svamp"]
    assert expand_eval_tasks(["SST-2", "glue8"])[:2] == ["sst2", "cola"]
    with pytest.raises(ValueError, match="unknown eval set"):
        expand_eval_tasks(["boolq"])
    glue = make_fake_glue(tmp_path / "d" / "glue")
    make_math_dir(tmp_path / "d")
    sets, missing = resolve_eval_sets(["glue8", "math"], tmp_path / "d", limit=3)
    names = [s.name for s in sets]
    assert names == ["cola", "sst2", "mrpc", "stsb", "mnli_matched", "mnli_mismatched", "qnli", "rte", "gsm8k", "aqua"]
    assert set(missing) == {"qqp", "mawps", "svamp"}
    assert all(len(s.records) == len(s.golds) == 3 for s in sets) and sets[0].total == 12
    assert sets[-2].golds == ["0.0", "1.0", "2.0"]  # `answer`, not the non-gold `output`
    assert all(r["output"] == "" for s in sets for r in s.records)
    with pytest.raises(FileNotFoundError, match="none of the eval sets"):
        resolve_eval_sets(["qqp"], glue)
    with pytest.raises(ConfigError, match="eval_tasks"):
        TrainConfig(task="sst2", eval_tasks=["math"])


def test_run_eval_sets_bookkeeping(llama, tmp_path):
    model, tok = llama
    make_fake_glue(tmp_path / "d" / "glue")
    make_math_dir(tmp_path / "d")
    sets, _ = resolve_eval_sets(["stsb", "rte", "mnli", "gsm8k", "aqua"], tmp_path / "d", limit=4)
    res = run_eval_sets(model, tok, sets, batch_size=3, max_new_tokens=3, generations_dir=tmp_path / "gen")
    assert list(res) == ["stsb", "rte", "mnli_matched", "mnli_mismatched", "gsm8k", "aqua"]  # requested order
    for name, ev in res.items():
        lines = [json.loads(x) for x in (tmp_path / "gen" / f"{name}.jsonl").read_text().splitlines()]
        assert ev["n"] == len(lines) == 4 and ev["total"] == (5 if name in ("gsm8k", "aqua") else 12)
        assert ev["max_new_tokens"] == 3 and ev["decoding"] == "greedy" and 0 <= ev["unfinished"] <= 4
        if name == "gsm8k":
            assert [x["pred"] for x in lines] == [extract_number(x["generation"]) for x in lines]
        elif name == "aqua":
            assert [x["pred"] for x in lines] == [extract_choice(x["generation"], rule="first") for x in lines]
        else:
            assert [x["gold"] for x in lines] == [s.golds for s in sets if s.name == name][0]
        bad = sum(x["pred"] is None for x in lines)
        assert ev["unparsed"] == bad and ev["parse_rate"] == pytest.approx(1 - bad / 4)
    scores = table_scores(res)
    assert set(scores) == {"stsb", "mnli", "rte", "gsm8k", "aqua"}
    assert scores["mnli"] == pytest.approx((res["mnli_matched"]["accuracy"] + res["mnli_mismatched"]["accuracy"]) / 2)


def test_train_glue8_and_instruct_with_generation_eval(tiny_llama_dir, tmp_path):
    glue = make_fake_glue(tmp_path / "glue", n_train=12, n_dev=6)
    base = dict(model=tiny_llama_dir, steps=1, batch_size=8, micro_batch_size=8, rank=2, alpha=4, lr=1e-3,
                max_length=96, eval_examples=3, max_new_tokens=2, eval_batch_size=8, epsilon=8.0)
    res = train(TrainConfig(task="glue8", data=str(glue), glue8_per_task=3, output=str(tmp_path / "g8"), **base),
                **QUIET)
    s = res.summary
    assert set(s["eval"]) == {"cola", "sst2", "mrpc", "stsb", "mnli_matched", "mnli_mismatched", "qnli", "rte"}
    scores = table_scores(s["eval"], "glue8")
    assert set(s["eval_missing"]) == {"qqp"} and "qqp" not in scores and "mnli" in scores
    assert all(ev["n"] == 3 for ev in s["eval"].values())
    cfg = json.loads((tmp_path / "g8" / "config.json").read_text())
    assert cfg["dataset_size"] == 24 and cfg["data_notes"]["glue8_rte"] == 3 and cfg["eval_tasks"] is None
    assert json.loads((tmp_path / "g8" / "summary.json").read_text())["eval_missing"]["qqp"]
    assert len((tmp_path / "g8" / "generations" / "cola.jsonl").read_text().splitlines()) == 3

    math_dir = make_math_dir(tmp_path / "math")
    train_file = math_dir / "train.json"
    train_file.write_text(json.dumps([{"instruction": f"add {i} and 1", "input": "", "output": f"{i + 1}"}
                                      for i in range(16)]))
    res = train(TrainConfig(task="instruct", data=str(train_file), eval_tasks="math", aqua_rule="last",
                            output=str(tmp_path / "m"), **base), **QUIET)
    assert set(res.summary["eval"]) == {"gsm8k", "aqua"} and set(res.summary["eval_missing"]) == {"mawps", "svamp"}
    assert res.summary["eval"]["aqua"]["aqua_rule"] == "last" and res.summary["eval"]["gsm8k"]["n"] == 3
