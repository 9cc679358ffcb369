"""The GLUE8 mixture builder: counts, seeded determinism, the instruction format, STS-B targets."""

import json
import re

import pytest

from prismdp.data import generate_prompt, load_glue, load_instruct_json
from prismdp.data.glue8 import (GLUE8_TASKS, INSTRUCTIONS, build_glue8, format_output, glue8_examples, glue8_records,
                                main as glue8_main, to_instruct_record, write_glue8_json)
from prismdp.data.tasks import glue_task
from prismdp.eval.answers import parse_glue_label
from prismdp.data.splits import seeded_subset


def make_fake_glue(root, n_train=30, n_dev=12, qqp_dev=False):
    """A tiny GLUE folder in the official TSV layout (QQP without a dev file, like /work/shared/data)."""
    def write(task_dir, name, header, rows):
        d = root / task_dir
        d.mkdir(parents=True, exist_ok=True)
        lines = ([header] if header else []) + ["\t".join(map(str, r)) for r in rows]
        (d / name).write_text("\n".join(lines) + "\n")

    for split, n, fname in (("train", n_train, "train.tsv"), ("dev", n_dev, "dev.tsv")):
        write("CoLA", fname, None, [("src", i % 2, "", f"cola {split} sentence {i} .") for i in range(n)])
        write("SST-2", fname, "sentence\tlabel", [(f"sst {split} movie {i} ", (i // 2) % 2) for i in range(n)])
        write("MRPC", fname, "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String",
              [(i % 2, i, i + 1, f"mrpc a {split} {i}", f"mrpc b {split} {i}") for i in range(n)])
        write("STS-B", fname, "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
              [(i, "g", "f", "y", i, "s", "s", f"stsb a {split} {i}", f"stsb b {split} {i}", f"{(i * 0.37) % 5:.3f}")
               for i in range(n)])
        if split == "train" or qqp_dev:
            write("QQP", fname, "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
                  [(i, i, i, f"qqp q1 {split} {i}?", f"qqp q2 {split} {i}?", i % 2) for i in range(n)])
        write("QNLI", fname, "index\tquestion\tsentence\tlabel",
              [(i, f"qnli q {split} {i}?", f"qnli s {split} {i}.", ["entailment", "not_entailment"][i % 2])
               for i in range(n)])
        write("RTE", fname, "index\tsentence1\tsentence2\tlabel",
              [(i, f"rte p {split} {i}.", f"rte h {split} {i}.", ["entailment", "not_entailment"][i % 2])
               for i in range(n)])
    mnli = [("sentence1", "sentence2", "gold_label")]
    labels = ["entailment", "neutral", "contradiction"]
    write("MNLI", "train.tsv", "\t".join(mnli[0]),
          [(f"mnli p {i}", f"mnli h {i}", labels[i % 3]) for i in range(n_train)])
    for name in ("dev_matched.tsv", "dev_mismatched.tsv"):
        write("MNLI", name, "\t".join(mnli[0]), [(f"mnli {name} p {i}", f"h {i}", labels[i % 3]) for i in range(n_dev)])
    return root


@pytest.fixture
def fake_glue(tmp_path):
    return make_fake_glue(tmp_path / "glue")


def test_counts_order_and_small_tasks(fake_glue):
    items = build_glue8(fake_glue, per_task=10, seed=1)
    assert len(items) == 80
    assert [it.task for it in items] == [t for t in GLUE8_TASKS for _ in range(10)]
    # a task with fewer train examples than per_task is taken whole
    assert len(build_glue8(fake_glue, per_task=50, seed=1, tasks=["rte"])) == 30
    assert len(build_glue8(fake_glue, per_task=None, seed=1)) == 8 * 30
    with pytest.raises(ValueError, match="duplicate"):
        build_glue8(fake_glue, per_task=5, tasks=["rte", "RTE"])


def test_seeded_determinism_and_same_rule_as_the_trainer(fake_glue):
    a = build_glue8(fake_glue, per_task=10, seed=7)
    assert a == build_glue8(fake_glue, per_task=10, seed=7)
    assert a != build_glue8(fake_glue, per_task=10, seed=8)
    # each task's sample depends on that task alone, and equals the trainer's train_examples subset
    sst2 = [it.example for it in a if it.task == "sst2"]
    assert glue8_examples(fake_glue, per_task=10, seed=7, tasks=["sst2"])["sst2"] == sst2
    full = load_glue("sst2", "train", fake_glue)
    assert sst2 == seeded_subset(full, 10, 7)  # the trainer's train_examples rule (one function)
    assert len(set(sst2)) == 10 and all(ex in full for ex in sst2)


def test_instructions_name_the_label_words_and_outputs_parse_back(fake_glue):
    assert INSTRUCTIONS["cola"] == ("Task: CoLA (linguistic acceptability). Determine whether the sentence is "
                                    "grammatically acceptable. Answer with exactly one label: acceptable, "
                                    "unacceptable.")
    items = build_glue8(fake_glue, per_task=10, seed=3)
    for it, rec in zip(items, glue8_records(items)):
        assert set(rec) == {"instruction", "input", "output"}
        assert rec["instruction"] == INSTRUCTIONS[it.task]
        if it.task != "stsb":
            words = glue_task(it.task).label_names
            assert all(re.search(rf"\b{w}\b", rec["instruction"]) for w in words), it.task
            assert rec["output"] == words[it.example.label]
        assert parse_glue_label(it.task, rec["output"]) == pytest.approx(it.example.label, abs=0.05)
        assert it.example.text_a in rec["input"]
        if it.example.text_b is not None:
            assert rec["input"].count("\n") == 1 and rec["input"].endswith(it.example.text_b)
    rec = to_instruct_record("mnli", next(i for i in items if i.task == "mnli").example)
    assert rec["input"].startswith("Premise: ") and "\nHypothesis: " in rec["input"]
    assert to_instruct_record("sst2", items[10].example)["input"].startswith("Sentence: ")
    # the prompt the model sees at training and evaluation time is the LLM-Adapters template
    assert "### Input:" in generate_prompt({**rec, "output": ""})


def test_stsb_targets_have_one_decimal():
    assert format_output("stsb", 3.8) == "3.8"
    assert format_output("stsb", 5.0) == "5.0" and format_output("stsb", 0) == "0.0"
    assert format_output("stsb", 2.4) == "2.4" and format_output("stsb", 1.04) == "1.0"
    for bad in (5.2, -0.1):
        with pytest.raises(ValueError):
            format_output("stsb", bad)
    with pytest.raises(ValueError):
        format_output("mnli", 3)
    assert format_output("qnli", 1) == "not_entailment" and format_output("mrpc", 0) == "not_equivalent"


def test_write_json_and_module_cli(fake_glue, tmp_path, capsys):
    items = build_glue8(fake_glue, per_task=4, seed=0)
    p = write_glue8_json(tmp_path / "g8.json", items)
    assert load_instruct_json(p) == glue8_records(items)
    assert glue8_main(["--data", str(fake_glue), "--out", str(tmp_path / "c.json"), "--per-task", "3"]) == 0
    assert len(json.loads((tmp_path / "c.json").read_text())) == 24
    assert "rte 3" in capsys.readouterr().out


def test_real_glue_data_gives_the_papers_10000(shared_data):
    items = build_glue8(shared_data / "glue", seed=42)
    counts = {t: sum(it.task == t for it in items) for t in GLUE8_TASKS}
    assert counts == {t: 1250 for t in GLUE8_TASKS}
    stsb = [r["output"] for it, r in zip(items, glue8_records(items)) if it.task == "stsb"]
    assert all(re.fullmatch(r"[0-5]\.\d", s) for s in stsb)
