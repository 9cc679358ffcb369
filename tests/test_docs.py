"""The README stays a short entry point, and no relative link in README.md or docs/ is broken.

`mkdocs build --strict` (.ci/run) checks the pages under docs/; the README lies outside the site, so its links, and
the anchors of its table of contents, are checked here (GitHub's heading anchors); links of the docs pages too, with
the anchors both the site and GitHub give a heading, so that a broken link fails without mkdocs installed.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text without code blocks and code spans (their brackets are not links)."""
    return _CODE.sub("", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``-`` and ``_`` kept), each space a ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def site_slug(heading: str) -> str:
    """The anchor mkdocs gives a heading (Python-Markdown's toc slugify)."""
    from markdown.extensions.toc import slugify

    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return slugify(text, "-")


def anchors(path: Path, slug) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}" if slug is github_slug else f"{base}_{n}")
    return out


def relative_links(path: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(path.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken_links(path: Path, *slugs) -> list[str]:
    """Relative links of ``path`` whose file is missing, or whose anchor is not a heading's under every rule in
    ``slugs`` (a docs page is read both on the site and on GitHub)."""
    broken = []
    for target in relative_links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and any(anchor not in anchors(dest, slug) for slug in slugs):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)} (GitHub and "
                          "mkdocs write some anchors differently, e.g. of a heading with `--flag`: reword it)")
    return broken


def test_readme_is_at_most_250_lines():
    n = len(README.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; move the detail to a docs/ page and link it from the index"


def test_readme_has_a_table_of_contents_naming_every_section():
    text = README.read_text()
    m = re.search(r"^## Contents\n(.*?)^## ", text, re.S | re.M)
    assert m, "README.md has no '## Contents' section"
    toc = re.findall(r"\]\(#([^)]+)\)", m.group(1))
    sections = {github_slug(h) for h in re.findall(r"^## (.*)$", _FENCE.sub("", text), re.M)} - {"contents"}
    assert set(toc) <= anchors(README, github_slug), f"contents entries without a heading: {set(toc) - sections}"
    assert sections <= set(toc), f"sections missing from the contents: {sections - set(toc)}"


def test_every_relative_link_of_the_readme_resolves():
    assert relative_links(README), "no relative link found: the link pattern is wrong"
    assert broken_links(README, github_slug) == []


@pytest.mark.parametrize("page", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_relative_link_of_a_docs_page_resolves(page):
    pytest.importorskip("markdown")
    assert broken_links(page, site_slug, github_slug) == []


def test_the_slugs_match_githubs_and_mkdocs():
    """Anchors of headings of this repository: mkdocs' as read off the built site's ids, GitHub's by its rule (lower
    case, punctuation but ``-`` dropped, every space a ``-``, so ``--fsdp --quantize`` keeps three hyphens)."""
    assert github_slug("What the privacy report means") == "what-the-privacy-report-means"
    assert github_slug("`--fsdp --quantize 4bit`: QLoRA sharded") == "--fsdp---quantize-4bit-qlora-sharded"
    assert github_slug("The adaptive step's default: `preset: paper`") == "the-adaptive-steps-default-preset-paper"
    assert github_slug("Rank 0's host memory under `--fsdp`") == "rank-0s-host-memory-under---fsdp"
    pytest.importorskip("markdown")
    assert site_slug("`--fsdp --quantize 4bit`: QLoRA sharded") == "-fsdp-quantize-4bit-qlora-sharded"
    assert site_slug("Rank 0's host memory under `--fsdp`") == "rank-0s-host-memory-under-fsdp"
