"""The package's layering, checked on the source (docs/architecture.md): which subpackage may import which."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "prismdp"


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of the prismdp modules a file imports (relative imports resolved), at any depth."""
    package = ".".join(("prismdp", *path.relative_to(SRC).with_suffix("").parts))
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out |= {name} | {f"{name}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("prismdp")}


@pytest.mark.parametrize("package,forbidden", [
    ("data", ("prismdp.eval", "prismdp.train", "prismdp.experiment", "prismdp.diagnostics", "prismdp.engine")),
    ("eval", ("prismdp.train", "prismdp.experiment", "prismdp.diagnostics", "prismdp.engine")),
])
def test_lower_layers_do_not_import_higher_ones(package, forbidden):
    bad = {f"{p.relative_to(SRC)} imports {m}" for p in (SRC / package).rglob("*.py")
           for m in _imported_modules(p) if m.startswith(forbidden)}
    assert not bad, sorted(bad)
