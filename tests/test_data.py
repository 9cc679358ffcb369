"""Tests of prismdp.data: GLUE readers (real files + malformed ones), LLM-Adapters instruction data, the synthetic
task, classification tokenisation and collation.

Real data is read from /work/shared/data (override with PRISMDP_SHARED_DATA); tests needing it skip when absent.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections import Counter
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from prismdp.data import (  # noqa: E402
    Example,
    GlueDataError,
    InstructDataError,
    build_instruct_dataset,
    encode_classification,
    generate_prompt,
    glue_task,
    load_glue,
    load_instruct_json,
    make_synthetic_task,
    pad_collate,
    tokenize_instruct,
)
from prismdp.data import synthetic  # noqa: E402

SHARED = Path(os.environ.get("PRISMDP_SHARED_DATA", "/work/shared/data"))
GLUE = SHARED / "glue"
MATH = SHARED / "math"
IND = " " * 16  # LLM-Adapters' template indentation


@pytest.fixture(scope="module")
def glue_dir():
    if not GLUE.is_dir():
        pytest.skip(f"GLUE data not available at {GLUE}")
    return GLUE


@pytest.fixture(scope="module")
def math_dir():
    if not (MATH / "math_10k.json").is_file():
        pytest.skip(f"math data not available at {MATH}")
    return MATH


@pytest.fixture(scope="module")
def lm_tokenizer():
    """The SmolLM2 tokenizer from the packaged GGUF (the causal-LM tokenizer prismdp uses by default)."""
    from prismdp.models import ModelLoadError, default_causal_lm

    try:
        folder, fname = default_causal_lm()
    except ModelLoadError as e:
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, gguf_file=fname)


@pytest.fixture(scope="module")
def bert_tokenizer():
    from prismdp.models import ModelLoadError, default_encoder_path

    try:
        folder = default_encoder_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


# ---------------------------------------------------------------------------------------------------------------
# GLUE registry


def test_registry_label_orders_match_hf_datasets():
    assert glue_task("cola").label_names == ("unacceptable", "acceptable")
    assert glue_task("SST-2").label_names == ("negative", "positive")
    assert glue_task("mrpc").label_names == ("not_equivalent", "equivalent")
    assert glue_task("qqp").label_names == ("not_duplicate", "duplicate")
    assert glue_task("mnli").label_names == ("entailment", "neutral", "contradiction")
    assert glue_task("qnli").label_names == ("entailment", "not_entailment")
    assert glue_task("rte").label_names == ("entailment", "not_entailment")
    stsb = glue_task("sts-b")
    assert stsb.is_regression and stsb.num_labels == 1 and stsb.label_names is None
    assert glue_task("mnli").splits == ("train", "validation_matched", "validation_mismatched")
    assert [t.num_labels for t in map(glue_task, ["cola", "sst2", "mrpc", "qqp", "mnli", "qnli", "rte"])] == [
        2, 2, 2, 2, 3, 2, 2]
    assert glue_task("rte").text_fields == ("sentence1", "sentence2")
    with pytest.raises(KeyError, match="unknown GLUE task"):
        glue_task("wnli")


# ---------------------------------------------------------------------------------------------------------------
# GLUE readers on the real files (counts from SOURCES.md)

REAL = [
    ("sst2", "validation", "tsv", 872, {0, 1}),
    ("sst2", "validation", "hf", 872, {0, 1}),
    ("sst2", "train", "tsv", 67349, {0, 1}),
    ("cola", "train", "tsv", 8551, {0, 1}),
    ("cola", "train", "hf", 8551, {0, 1}),
    ("cola", "validation", "tsv", 1043, {0, 1}),
    ("mrpc", "validation", "tsv", 408, {0, 1}),
    ("mrpc", "train", "tsv", 3667, {0, 1}),  # the TSV copy misses one row (SOURCES.md caveat)
    ("mrpc", "train", "hf", 3668, {0, 1}),
    ("stsb", "validation", "tsv", 1500, None),
    ("stsb", "train", "hf", 5749, None),
    ("qnli", "validation", "tsv", 5463, {0, 1}),
    ("rte", "train", "tsv", 2490, {0, 1}),
    ("rte", "validation", "hf", 277, {0, 1}),
    ("mnli", "validation_matched", "hf", 9815, {0, 1, 2}),
    ("mnli", "validation_mismatched", "auto", 9832, {0, 1, 2}),
]


@pytest.mark.parametrize("task,split,fmt,n,labels", REAL, ids=[f"{t}-{s}-{f}" for t, s, f, _, _ in REAL])
def test_real_glue_counts_and_labels(glue_dir, task, split, fmt, n, labels):
    data = load_glue(task, split, glue_dir, fmt=fmt)
    assert len(data) == n
    assert all(isinstance(e, Example) and isinstance(e.text_a, str) and e.text_a for e in data)
    if glue_task(task).is_pair:
        assert all(isinstance(e.text_b, str) for e in data)
    else:
        assert all(e.text_b is None for e in data)
    if labels is None:
        assert all(isinstance(e.label, float) and 0.0 <= e.label <= 5.0 for e in data)
    else:
        assert all(type(e.label) is int for e in data)
        assert set(e.label for e in data) == labels


def test_real_glue_known_rows(glue_dir):
    sst = load_glue("sst2", "validation", glue_dir, fmt="tsv")
    assert sst[0] == Example("it 's a charming and often affecting journey . ", None, 1)  # trailing space kept
    cola = load_glue("cola", "validation", glue_dir, fmt="tsv")  # no header: first row is data
    assert cola[0] == Example("The sailors rode the breeze clear of the rocks.", None, 1)
    rte = load_glue("rte", "validation", glue_dir, fmt="tsv")
    assert rte[0].text_b == "Christopher Reeve had an accident." and rte[0].label == 1  # not_entailment
    qnli = load_glue("qnli", "validation", glue_dir, fmt="tsv")
    assert qnli[0].text_a == "What came into force after the new constitution was herald?" and qnli[0].label == 0
    mrpc = load_glue("mrpc", "validation", glue_dir, fmt="tsv")  # file starts with a BOM
    assert not mrpc[0].text_a.startswith("\ufeff") and mrpc[0].label == 1
    stsb = load_glue("stsb", "validation", glue_dir, fmt="tsv")
    assert stsb[0] == Example("A man with a hard hat is dancing.", "A man wearing a hard hat is dancing.", 5.0)
    mnli = load_glue("mnli", "validation_matched", glue_dir)
    assert mnli[0] == Example("The new rights are nice enough", "Everyone really likes the newest benefits ", 1)


@pytest.mark.parametrize("task", ["sst2", "cola", "rte", "qnli", "mrpc", "stsb"])
def test_tsv_and_hf_exports_agree(glue_dir, task):
    a = load_glue(task, "validation", glue_dir, fmt="tsv")
    b = load_glue(task, "validation", glue_dir, fmt="hf")
    assert [(e.text_a, e.text_b) for e in a] == [(e.text_a, e.text_b) for e in b]
    if task == "stsb":  # parquet stores float32
        assert max(abs(x.label - y.label) for x, y in zip(a, b)) < 1e-5
    else:
        assert [e.label for e in a] == [e.label for e in b]


def test_auto_prefers_hf_export(glue_dir):
    assert len(load_glue("mrpc", "train", glue_dir)) == 3668
    assert len(load_glue("MRPC", "dev", glue_dir / "MRPC")) == 408  # task folder itself + split alias


@pytest.mark.parametrize("task,labels", [("mnli", {0, 1, 2}), ("qnli", {0, 1}), ("qqp", {0, 1})])
def test_real_train_subsets(glue_dir, task, labels):
    with pytest.warns(UserWarning, match="subset"):
        data = load_glue(task, "train", glue_dir)
    assert len(data) == 9999  # train_subset_8999.json + train_subset_1000.json
    assert set(e.label for e in data) == labels
    assert all(e.text_b for e in data)


def test_real_train_subset_label_mapping(glue_dir):
    raw = json.loads((glue_dir / "MNLI" / "train_subset_1000.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = load_glue("mnli", "train", glue_dir, fmt="subset")
    names = glue_task("mnli").label_names
    first_1000 = data[:1000]  # files are read in name order: train_subset_1000 first
    assert [names[e.label] for e in first_1000] == [raw[str(i)]["label"] for i in range(1000)]


def test_missing_qqp_validation_is_a_clear_error(glue_dir):
    with pytest.raises(FileNotFoundError, match=r"dev\.tsv"):
        load_glue("qqp", "validation", glue_dir)


# ---------------------------------------------------------------------------------------------------------------
# GLUE readers: bad input


def _write(path: Path, text: str, encoding="utf-8") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding=encoding)
    return path


def test_missing_file_names_path_and_layout(tmp_path):
    (tmp_path / "SST-2").mkdir()
    with pytest.raises(FileNotFoundError) as ei:
        load_glue("sst2", "validation", tmp_path)
    msg = str(ei.value)
    assert str(tmp_path / "SST-2" / "dev.tsv") in msg and "official GLUE layout" in msg


def test_missing_task_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="SST-2"):
        load_glue("sst2", "validation", tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_glue("sst2", "validation", tmp_path / "nowhere")


def test_wrong_columns(tmp_path):
    _write(tmp_path / "SST-2" / "dev.tsv", "text\tlabel\nnice film\t1\n")
    with pytest.raises(GlueDataError, match="wrong columns.*sentence"):
        load_glue("sst2", "validation", tmp_path)


def test_wrong_column_count_names_line(tmp_path):
    _write(tmp_path / "RTE" / "dev.tsv", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tentailment\n")
    with pytest.raises(GlueDataError, match=r"dev\.tsv:3: 3 tab-separated columns, expected 4"):
        load_glue("rte", "validation", tmp_path)


def test_cola_without_four_columns(tmp_path):
    _write(tmp_path / "CoLA" / "train.tsv", "gj04\t1\tThe sailors rode the breeze.\n")
    with pytest.raises(GlueDataError, match="expected 4"):
        load_glue("cola", "train", tmp_path, fmt="tsv")


def test_empty_set(tmp_path):
    _write(tmp_path / "SST-2" / "dev.tsv", "sentence\tlabel\n")
    with pytest.raises(GlueDataError, match="no examples"):
        load_glue("sst2", "validation", tmp_path)
    _write(tmp_path / "RTE" / "dev.tsv", "")
    with pytest.raises(GlueDataError, match="empty file"):
        load_glue("rte", "validation", tmp_path)


@pytest.mark.parametrize("task,folder,text,pattern", [
    ("sst2", "SST-2", "sentence\tlabel\ngood\t1\nbad\t2\n", r"label 2 is outside"),
    ("rte", "RTE", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n", r"'maybe' is not in the rte label set"),
    ("stsb", "STS-B", "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
                      "0\tg\tf\t2012\t0\tn\tn\ta\tb\t7.5\n", r"outside \[0, 5\]"),
    ("mrpc", "MRPC", "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\nx\t1\t2\ta\tb\n", r"'x' is not in"),
])
def test_labels_outside_label_set(tmp_path, task, folder, text, pattern):
    _write(tmp_path / folder / "dev.tsv", text)
    with pytest.raises(GlueDataError, match=pattern):
        load_glue(task, "validation", tmp_path)


def test_tsv_quotes_are_literal(tmp_path):
    # csv.QUOTE_NONE: a sentence starting with " must not swallow the tab and the label
    _write(tmp_path / "SST-2" / "dev.tsv", 'sentence\tlabel\n" quoted start\t1\nplain\t0\n')
    data = load_glue("sst2", "validation", tmp_path)
    assert data == [Example('" quoted start', None, 1), Example("plain", None, 0)]


def test_parquet_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    d = tmp_path / "SST-2"
    d.mkdir()
    pq.write_table(pa.table({"sentence": ["a", "b"], "label": [0, -1], "idx": [0, 1]}), d / "hf_validation.parquet")
    with pytest.raises(GlueDataError, match="unlabelled"):
        load_glue("sst2", "validation", tmp_path)
    pq.write_table(pa.table({"text": ["a"], "label": [0]}), d / "hf_validation.parquet")
    with pytest.raises(GlueDataError, match=r"wrong columns.*'sentence'"):
        load_glue("sst2", "validation", tmp_path)
    pq.write_table(pa.table({"sentence": ["a", "b"], "label": [1, 0], "idx": [0, 1]}), d / "hf_validation.parquet")
    assert load_glue("sst2", "validation", tmp_path) == [Example("a", None, 1), Example("b", None, 0)]


def test_subset_json_errors(tmp_path):
    _write(tmp_path / "QQP" / "train_subset_10.json", json.dumps({"0": {"text_a": "q1", "label": "1"}}))
    with pytest.raises(GlueDataError, match=r"missing \['text_b'\]"):
        load_glue("qqp", "train", tmp_path)
    _write(tmp_path / "QQP" / "train_subset_10.json",
           json.dumps({"0": {"text_a": "q1", "text_b": "q2", "label": "duplicate?"}}))
    with pytest.raises(GlueDataError, match="not in the qqp label set"):
        load_glue("qqp", "train", tmp_path)


def test_split_errors(tmp_path):
    with pytest.raises(ValueError, match="validation_matched or validation_mismatched"):
        load_glue("mnli", "validation", tmp_path)
    with pytest.raises(ValueError, match="no public labels"):
        load_glue("sst2", "test", tmp_path)
    with pytest.raises(ValueError, match="train split only"):
        load_glue("qqp", "validation", tmp_path, fmt="subset")


def test_a_folder_in_a_files_place_is_a_clear_error(tmp_path):
    (tmp_path / "SST-2" / "train.tsv").mkdir(parents=True)  # was: IsADirectoryError traceback
    with pytest.raises(GlueDataError, match=r"train\.tsv is a folder, but GLUE sst2 train data there must be a file"):
        load_glue("sst2", "train", tmp_path)
    _write(tmp_path / "SST-2" / "hf_validation", "not a folder")  # a datasets save_to_disk folder expected
    with pytest.raises(GlueDataError, match="hf_validation is a file.*save_to_disk folder"):
        load_glue("sst2", "validation", tmp_path)
    (tmp_path / "QQP" / "train_subset_1.json").mkdir(parents=True)
    with pytest.raises(GlueDataError, match="is a folder"):
        load_glue("qqp", "train", tmp_path)
    (tmp_path / "math.json").mkdir()
    with pytest.raises(InstructDataError, match=r"math\.json is a folder"):
        load_instruct_json(tmp_path / "math.json")


def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path):
    """A Latin-1 byte (was: a bare 'utf-8' codec error naming no file)."""
    d = tmp_path / "SST-2"
    d.mkdir()
    (d / "train.tsv").write_bytes(b"sentence\tlabel\ngood\t1\ncaf\xe9 good\t1\n")
    with pytest.raises(GlueDataError, match=r"train\.tsv:3: byte 0xe9 at column 4 is not UTF-8.*iconv"):
        load_glue("sst2", "train", tmp_path)
    (d / "dev.tsv").write_bytes("\ufeffsentence\tlabel\ncafé\t1\n".encode("utf-8"))  # UTF-8 with a BOM is fine
    assert load_glue("sst2", "validation", tmp_path) == [Example("café", None, 1)]
    (tmp_path / "QQP").mkdir()
    (tmp_path / "QQP" / "train_subset_1.json").write_bytes(b'{"0": {"text_a": "\xff", "text_b": "b", "label": 1}}')
    with pytest.raises(GlueDataError, match=r"train_subset_1\.json:1: byte 0xff"):
        load_glue("qqp", "train", tmp_path)
    p = tmp_path / "data.json"
    p.write_bytes(b'[{"instruction": "a",\n "input": "\xe9", "output": "b"}]')
    with pytest.raises(InstructDataError, match=r"data\.json:2: byte 0xe9 at column 12"):
        load_instruct_json(p)


def test_hub_fallback_without_datasets_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(ImportError, match="pip install datasets.*data_dir"):
        load_glue("sst2", "validation")


# ---------------------------------------------------------------------------------------------------------------
# LLM-Adapters instruction data

REC_IN = {"instruction": "Classify the sentiment.", "input": "Sentence: a charming journey.", "output": "positive"}
REC_NO = {"instruction": "What is 2 + 3?", "input": "", "output": "The answer is 5."}


def test_prompt_template_exact():
    assert generate_prompt(REC_IN) == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request. \n\n"
        "                ### Instruction:\n"
        "                Classify the sentiment.\n"
        "                \n"
        "                ### Input:\n"
        "                Sentence: a charming journey.\n"
        "                \n"
        "                ### Response:\n"
        "                positive"
    )
    assert generate_prompt(REC_NO) == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request.  "
        "\n\n"
        "                ### Instruction:\n"
        "                What is 2 + 3?\n"
        "                \n"
        "                ### Response:\n"
        "                The answer is 5."
    )
    # braces in user text are not format fields
    assert "{x}" in generate_prompt({"instruction": "{x}", "input": "", "output": ""})


def test_load_real_instruct_files(math_dir):
    recs = load_instruct_json(math_dir / "math_10k.json")
    assert len(recs) == 9919
    assert all(r["input"] == "" for r in recs)
    assert recs[0]["answer"] == "16.0" and recs[0]["instruction"].endswith("\n ")
    assert generate_prompt(recs[0]).startswith(
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.  \n\n" + IND + "### Instruction:\n" + IND + "At the arcade Dave won 11 tickets .")
    assert len(load_instruct_json(math_dir / "gsm8k_test.json")) == 1319
    assert len(load_instruct_json(math_dir / "aqua_test.json")) == 254


@pytest.mark.parametrize("content,pattern", [
    ("", "empty file"),
    ("[]", "no records"),
    ('{"instruction": "a", "input": "", "output": "b"}', "expected a JSON array"),
    ('[{"instruction": "a", "output": "b"}]', r"record 0: missing key\(s\) \['input'\]"),
    ('[{"instruction": "a", "input": "", "output": "b"}, {"instruction": 3, "input": "", "output": "b"}]',
     r"record 1: 'instruction' must be a string"),
    ('[{"instruction": "a", "input": ""', "invalid JSON"),
])
def test_instruct_bad_input(tmp_path, content, pattern):
    p = _write(tmp_path / "data.json", content)
    with pytest.raises(InstructDataError, match=pattern):
        load_instruct_json(p)


def test_instruct_missing_file_and_jsonl(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_instruct_json(tmp_path / "nope.json")
    p = _write(tmp_path / "d.jsonl", json.dumps(REC_IN) + "\n\n" + json.dumps({**REC_NO, "answer": "5"}) + "\n")
    assert load_instruct_json(p) == [REC_IN, {**REC_NO, "answer": "5"}]


def _decode(tok, ids):
    return tok.decode(ids, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("rec", [REC_IN, REC_NO], ids=["with_input", "no_input"])
def test_train_on_inputs_false_masks_exactly_the_prompt(lm_tokenizer, rec):
    tok = lm_tokenizer
    ex = tokenize_instruct(rec, tok, 256, train_on_inputs=False)
    ids, labels, p = ex["input_ids"], ex["labels"], ex["prompt_len"]
    assert len(ids) == len(labels) == len(ex["attention_mask"]) and set(ex["attention_mask"]) == {1}
    assert ex["truncated"] is False
    assert ids[-1] == tok.eos_token_id and labels[-1] == tok.eos_token_id  # EOS appended and trained on
    assert _decode(tok, ids[:-1]) == generate_prompt(rec)
    assert labels[:p] == [-100] * p
    assert labels[p:] == ids[p:] and -100 not in labels[p:]
    prompt = generate_prompt({**rec, "output": ""})
    # the masked tokens lie inside the prompt; the first trained token reaches into the output
    assert prompt.startswith(_decode(tok, ids[:p]))
    assert not prompt.startswith(_decode(tok, ids[: p + 1]))
    assert _decode(tok, ids[p:-1]).strip() == rec["output"]
    # LLM-Adapters' rule counts a separate tokenisation of the prompt
    la = tokenize_instruct(rec, tok, 256, train_on_inputs=False, prompt_mask="llm_adapters")
    assert la["prompt_len"] == len(tok(prompt)["input_ids"]) and la["input_ids"] == ids


def test_train_on_inputs_true_keeps_all_labels(lm_tokenizer):
    ex = tokenize_instruct(REC_IN, lm_tokenizer, 256, train_on_inputs=True)
    assert ex["labels"] == ex["input_ids"]


def test_truncation_flag_and_eos(lm_tokenizer):
    tok = lm_tokenizer
    n = len(tok(generate_prompt(REC_NO))["input_ids"])  # without EOS
    fits = tokenize_instruct(REC_NO, tok, n + 1, False)
    assert not fits["truncated"] and len(fits["input_ids"]) == n + 1 and fits["input_ids"][-1] == tok.eos_token_id
    no_room_for_eos = tokenize_instruct(REC_NO, tok, n, False)  # LLM-Adapters drops the EOS: counts as truncated
    assert no_room_for_eos["truncated"] and len(no_room_for_eos["input_ids"]) == n
    assert no_room_for_eos["input_ids"][-1] != tok.eos_token_id
    cut = tokenize_instruct(REC_NO, tok, n - 2, False)
    assert cut["truncated"] and len(cut["input_ids"]) == n - 2 == len(cut["labels"])
    assert cut["input_ids"] == tok(generate_prompt(REC_NO))["input_ids"][: n - 2]


def test_build_counts_truncation_and_fully_masked(lm_tokenizer):
    tok = lm_tokenizer
    long_rec = {**REC_NO, "output": "word " * 300}
    records = [REC_IN, long_rec, REC_NO, long_rec]
    res = build_instruct_dataset(records, tok, 64, train_on_inputs=False)
    assert res.n_truncated == 2 and res.n_fully_masked == 0 and len(res.examples) == 4
    assert [e["truncated"] for e in res.examples] == [False, True, False, True]
    assert all(len(e["input_ids"]) <= 64 for e in res.examples)

    prompt_len = len(tok(generate_prompt({**REC_IN, "output": ""}))["input_ids"])
    short = prompt_len - 5  # the REC_IN prompt alone overflows: no target tokens left
    with pytest.raises(InstructDataError, match=r"1 of 2 examples have no target tokens.*indices: \[0\]"):
        build_instruct_dataset([REC_IN, {**REC_NO, "instruction": "2+3?"}], tok, short, train_on_inputs=False)
    kept = build_instruct_dataset([REC_IN, {**REC_NO, "instruction": "2+3?"}], tok, short, train_on_inputs=False,
                                  fully_masked="keep")
    assert kept.n_fully_masked == 1 and kept.n_truncated == 1 and len(kept.examples) == 2
    assert set(kept.examples[0]["labels"]) == {-100}
    with pytest.raises(InstructDataError, match="no instruction records"):
        build_instruct_dataset([], tok, 64, False)


def test_build_matches_single_tokenisation(lm_tokenizer, math_dir):
    recs = load_instruct_json(math_dir / "math_10k.json")[:40]
    res = build_instruct_dataset(recs, lm_tokenizer, 128, train_on_inputs=False, fully_masked="keep")
    singles = [tokenize_instruct(r, lm_tokenizer, 128, False) for r in recs]
    assert res.examples == singles
    assert res.n_truncated == sum(e["truncated"] for e in singles) > 0
    assert res.n_fully_masked == sum(set(e["labels"]) == {-100} for e in singles) > 0  # long questions at 128


# ---------------------------------------------------------------------------------------------------------------
# synthetic task


def test_synthetic_deterministic_balanced_disjoint():
    tr, te = make_synthetic_task(301, 100, seed=7)
    tr2, te2 = make_synthetic_task(301, 100, seed=7)
    assert tr == tr2 and te == te2
    tr3, _ = make_synthetic_task(301, 100, seed=8)
    assert [e.text_a for e in tr3] != [e.text_a for e in tr]
    assert len(tr) == 301 and len(te) == 100
    assert Counter(e.label for e in tr) == {0: 150, 1: 151}
    assert Counter(e.label for e in te) == {0: 50, 1: 50}
    texts_tr, texts_te = [e.text_a for e in tr], [e.text_a for e in te]
    assert len(set(texts_tr)) == len(texts_tr) and len(set(texts_te)) == len(texts_te)
    assert not set(texts_tr) & set(texts_te)
    assert all(e.text_b is None and type(e.label) is int for e in tr + te)
    # train does not depend on n_test
    assert make_synthetic_task(301, 5, seed=7)[0] == tr


def test_synthetic_is_not_a_bag_of_words_task():
    tr, _ = make_synthetic_task(2000, 0, seed=0)
    assert 0.2 < sum(" not " in e.text_a or "n't " in e.text_a or " never " in e.text_a for e in tr) / 2000 < 0.6
    # sentences with a positive adjective occur with both labels (negation / contrast), same for negative ones
    for words in (synthetic.POSITIVE, synthetic.NEGATIVE):
        labels = Counter(e.label for e in tr if any(f" {w}." in e.text_a for w in words))
        assert labels[0] > 50 and labels[1] > 50
    assert any(", but " in e.text_a for e in tr) and any(e.text_a.startswith("Although") for e in tr)
    assert all(e.text_a[0].isupper() and e.text_a.endswith(".") for e in tr)


def test_synthetic_label_rules_on_examples():
    tr, _ = make_synthetic_task(3000, 0, seed=3)
    by_text = {e.text_a: e.label for e in tr}
    simple = [(t, y) for t, y in by_text.items() if t.count(".") == 1 and "," not in t]
    checked = 0
    for t, y in simple:  # single-clause reviews: label = polarity of the adjective, flipped by a negation
        for w in synthetic.POSITIVE + synthetic.NEGATIVE:
            if t.endswith(f" {w}."):
                negated = any(n in t for n in (" not ", "n't ", " never ", " hardly "))
                assert y == int((w in synthetic.POSITIVE) != negated), t
                checked += 1
    assert checked > 300


def test_synthetic_errors():
    with pytest.raises(ValueError):
        make_synthetic_task(-1, 5, seed=0)
    assert make_synthetic_task(0, 0, seed=0) == ([], [])


# ---------------------------------------------------------------------------------------------------------------
# classification tokenisation and collation


def test_encode_classification_pairs_and_truncation(bert_tokenizer):
    tok = bert_tokenizer
    exs = [Example("a short one", "another short one", 1),
           Example("word " * 40, "second " * 40, 0),
           Example("medium length sentence here", "ok", 1)]
    enc = encode_classification(exs, tok, max_length=16, num_labels=2)
    assert enc.n_truncated == 1
    f = enc.features
    assert len(f) == 3 and len(f[1]["input_ids"]) == 16 and len(f[0]["input_ids"]) < 16
    assert f[0]["input_ids"][0] == tok.cls_token_id and f[1]["input_ids"][-1] == tok.sep_token_id
    assert set(f[0]["token_type_ids"]) == {0, 1}  # pair encoding
    assert f[0]["labels"].dtype == torch.int64 and int(f[0]["labels"]) == 1
    batch = pad_collate(f, tok.pad_token_id)
    assert batch["input_ids"].shape == (3, 16) and batch["labels"].tolist() == [1, 0, 1]
    assert batch["labels"].dtype == torch.int64 and batch["token_type_ids"].shape == (3, 16)
    assert batch["attention_mask"][0].sum() == len(f[0]["input_ids"])


def test_decoder_pairs_are_separated_encoder_pairs_unchanged(lm_tokenizer, bert_tokenizer):
    """SmolLM2's tokenizer marks no boundary in a pair (its template is "$A $B"): the model must read the two sentences
    apart (a newline between them), also when the longer one is truncated; BERT's pair keeps its own template."""
    a, b = "It doesn't fit the company's strategy .", "The business does not fit our strategy ."
    enc = encode_classification([Example(a, b, 1), Example(a * 8, b, 0)], lm_tokenizer, 32, num_labels=2)
    assert lm_tokenizer.decode(enc.features[0]["input_ids"]) == a + "\n" + b
    cut = lm_tokenizer.decode(enc.features[1]["input_ids"])
    assert enc.n_truncated == 1 and len(enc.features[1]["input_ids"]) == 32
    assert cut.endswith("\n" + b)  # longest_first cuts the long premise, never the separator or the hypothesis
    f = encode_classification([Example(a, b, 1)], bert_tokenizer, 64, num_labels=2).features[0]
    assert f["input_ids"] == bert_tokenizer(a, b)["input_ids"]
    single = encode_classification([Example(a, None, 1)], lm_tokenizer, 64, num_labels=2).features[0]
    assert lm_tokenizer.decode(single["input_ids"]) == a


def test_blank_sentences_are_kept_and_counted(bert_tokenizer):
    exs = [Example("fine", None, 1), Example("", None, 0), Example(" \t ", None, 1), Example("ok", None, 0)]
    enc = encode_classification(exs, bert_tokenizer, max_length=16, num_labels=2)
    assert len(enc.features) == 4 and enc.n_blank == 2
    pairs = [Example("a", "b", 1), Example("a", "  ", 0), Example("", "b", 0)]
    assert encode_classification(pairs, bert_tokenizer, max_length=16, num_labels=2).n_blank == 2


def test_encode_classification_regression_and_errors(bert_tokenizer):
    tok = bert_tokenizer
    enc = encode_classification([Example("a", "b", 3.8), Example("c", "d", 1)], tok, 32, num_labels=1)
    assert enc.n_truncated == 0
    assert all(x["labels"].dtype == torch.float32 for x in enc.features)
    assert pad_collate(enc.features, 0)["labels"].tolist() == pytest.approx([3.8, 1.0])
    with pytest.raises(ValueError, match="outside 0..1"):
        encode_classification([Example("a", None, 2)], tok, 32, num_labels=2)
    with pytest.raises(ValueError, match="not an integer class index"):
        encode_classification([Example("a", None, 0.5)], tok, 32, num_labels=2)
    with pytest.raises(ValueError, match="mixed single-sentence"):
        encode_classification([Example("a", None, 0), Example("a", "b", 1)], tok, 32, num_labels=2)


def test_synthetic_encodes_and_collates(bert_tokenizer):
    tr, _ = make_synthetic_task(8, 0, seed=0)
    enc = encode_classification(tr, bert_tokenizer, 64, num_labels=2)
    assert enc.n_truncated == 0
    b = pad_collate(enc.features, bert_tokenizer.pad_token_id)
    assert b["input_ids"].shape[0] == 8 and b["labels"].shape == (8,)
    assert (b["input_ids"][b["attention_mask"] == 0] == bert_tokenizer.pad_token_id).all()


def test_pad_collate_causal_lm_right_padding():
    feats = [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7], "truncated": False},
             {"input_ids": torch.tensor([8]), "labels": [8]}]
    b = pad_collate(feats, pad_token_id=2)
    assert set(b) == {"input_ids", "attention_mask", "labels"}
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 2, 2]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert all(t.dtype == torch.int64 for t in b.values())
    b8 = pad_collate(feats, pad_token_id=0, pad_to_multiple_of=8)
    assert b8["input_ids"].shape == (2, 8) and b8["labels"][0, 3:].eq(-100).all()


def test_pad_collate_errors():
    with pytest.raises(ValueError, match="empty"):
        pad_collate([], 0)
    with pytest.raises(ValueError, match="labels has length 1 but input_ids has 2"):
        pad_collate([{"input_ids": [1, 2], "labels": [1]}], 0)
    with pytest.raises(ValueError, match="mixed scalar and sequence"):
        pad_collate([{"input_ids": [1], "labels": 1}, {"input_ids": [1], "labels": [1]}], 0)
    with pytest.raises(KeyError, match="input_ids"):
        pad_collate([{"labels": 1}], 0)
    with pytest.raises(ValueError, match="pad_token_id is None"):
        pad_collate([{"input_ids": [1]}], None)


def test_instruct_features_collate(lm_tokenizer):
    res = build_instruct_dataset([REC_IN, REC_NO], lm_tokenizer, 256, train_on_inputs=False)
    b = pad_collate(res.examples, lm_tokenizer.pad_token_id)
    lens = [len(e["input_ids"]) for e in res.examples]
    assert b["input_ids"].shape == (2, max(lens)) == b["labels"].shape
    short = lens.index(min(lens))
    assert b["labels"][short, min(lens):].eq(-100).all() and b["attention_mask"][short, min(lens):].eq(0).all()
    assert b["attention_mask"].sum().item() == sum(lens)


def test_carve_is_disjoint_seed_fixed_and_keeps_order():
    from prismdp.data.splits import carve, seeded_subset

    items = list(range(100))
    rest, held = carve(items, [("test", 20), ("val", 10)])
    assert len(held["test"]) == 20 and len(held["val"]) == 10 and len(rest) == 70
    assert sorted(rest + held["test"] + held["val"]) == items  # a partition
    assert all(part == sorted(part) for part in (rest, held["test"], held["val"]))
    assert carve(items, [("test", 20), ("val", 10)]) == (rest, held)  # fixed seed: the same for every run
    assert carve(items, [("test", 20)], seed=1)[1]["test"] != held["test"]
    with pytest.raises(ValueError, match="leave nothing"):
        carve(items, [("val", 100)])
    assert seeded_subset(items, 5, 0) == sorted(seeded_subset(items, 5, 0)) and seeded_subset(items, None, 0) == items


def test_holdout_splits_reach_the_trainer(tmp_path):
    from test_glue8 import make_fake_glue

    from prismdp.train.config import TrainConfig
    from prismdp.train.tasks import build_task_data
    from prismdp.models import load_model

    root = make_fake_glue(tmp_path, n_train=60, n_dev=12)
    tok = load_model(None, "seq_cls", 2)[1]
    data = build_task_data(TrainConfig(task="sst2", data=str(root), holdout_val=10, holdout_test=15), tok)
    assert set(data.eval_sets) == {"val", "test"}  # holdout_test replaces the official dev set
    assert len(data.train) == 35 and len(data.eval_sets["val"]) == 10 and len(data.eval_sets["test"]) == 15
    data = build_task_data(TrainConfig(task="sst2", data=str(root), holdout_val=10, seed=1), tok)
    assert set(data.eval_sets) == {"val", "validation"} and len(data.train) == 50
    with pytest.raises(ValueError, match="eval_splits"):
        build_task_data(TrainConfig(task="sst2", data=str(root), eval_splits=["validation_matched"]), tok)
