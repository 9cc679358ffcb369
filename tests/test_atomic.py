"""Atomic writes: the target is the old or the complete new content; concurrent writers never share a temporary."""

import json
import threading

import pytest

from prismdp.atomic import atomic_path, write_json, write_text


def test_write_replaces_whole_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "results.csv"
    target.write_text("old\n")
    write_text(target, "new\n")
    write_json(tmp_path / "a.json", {"b": 1, "a": "ε"})
    assert target.read_text() == "new\n"
    assert json.loads((tmp_path / "a.json").read_text()) == {"a": "ε", "b": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "results.csv"]


def test_a_failed_write_keeps_the_old_content(tmp_path):
    target = tmp_path / "summary.json"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("writer died")
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_concurrent_writers_use_their_own_temporaries(tmp_path):
    """Two writers inside their writes at once: with one shared temporary name, one would move the other's file."""
    target = tmp_path / "results.csv"
    both_open = threading.Barrier(2)
    names = []

    def writer(text):
        with atomic_path(target) as tmp:
            tmp.write_text(text[: len(text) // 2])
            names.append(tmp.name)
            both_open.wait(timeout=10)
            tmp.write_text(text)

    threads = [threading.Thread(target=writer, args=(t * 1000,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(names)) == 2
    assert target.read_text() in ("a" * 1000, "b" * 1000)
