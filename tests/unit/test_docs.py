"""The README stays short and the docs stay linked: the README's length, every relative link of
README.md and docs/*.md (file and heading), the README's list of docs against ``docs/*.md``
(the helpers' ``pending-*.md`` drafts aside), and the headline demo table, which the README and
docs/benchmarks.md both show, the same in both. Pure file reads."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS_DIR = ROOT / "docs"
README_MAX_LINES = 320  # "a README of at most about 300 lines" (issue 31)
READ_ON = "## Where to read on"
DEMO_TABLE_HEAD = "| policy | token hit rate | TTFT p50 |"

LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")  # [text](target), inline code blanked first
FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"(`+).*?\1")


def docs() -> list[Path]:
    """README.md and every docs/*.md, drafts included (their links must resolve too)."""
    return [README, *sorted(DOCS_DIR.glob("*.md"))]


def prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fenced code blocks, inline code spans blanked unless
    ``blank_code`` is false."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, INLINE_CODE.sub("", line) if blank_code else line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation dropped (``-`` and ``_``
    kept), each space a ``-``."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # backticks, dots, brackets, quotes, commas
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, repeated headings numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(), blank_code=False):
        match = re.match(r"#{1,6} (.+)", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def relative_links(path: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every link that is not a URL with a scheme."""
    return [
        (number, target)
        for number, line in prose_lines(path.read_text())
        for target in LINK.findall(line)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)
    ]


def test_slug_follows_github() -> None:
    assert (
        slug("5. Tenant isolation (API keys, per-tenant cache_salt)")
        == "5-tenant-isolation-api-keys-per-tenant-cache_salt"
    )
    assert (
        slug("The peer routers (pip install -e '.[peers]')")
        == "the-peer-routers-pip-install--e-peers"
    )
    assert slug("Router (`prefix-router serve`)") == "router-prefix-router-serve"
    assert (
        slug("The emulator fix behind this table (`e4b4f95`)")
        == "the-emulator-fix-behind-this-table-e4b4f95"
    )


def test_the_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail into docs/"
    )


def test_every_relative_link_resolves() -> None:
    broken = []
    for path in docs():
        for number, target in relative_links(path):
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not linked.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{where} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_lists_every_doc() -> None:
    text = README.read_text()
    assert READ_ON in text, f"README.md has no {READ_ON!r} section"
    section = text.split(READ_ON, 1)[1].split("\n## ", 1)[0]
    listed = {
        Path(target).name
        for target in LINK.findall(section)
        if target.startswith("docs/") and target.endswith(".md")
    }
    present = {p.name for p in DOCS_DIR.glob("*.md") if not p.name.startswith("pending-")}
    assert listed == present, (
        f"README's {READ_ON!r} lists {sorted(listed)}, docs/ holds {sorted(present)}: "
        "one line per doc in that list"
    )


def demo_table(path: Path) -> list[str]:
    """The rows of the demo table (the one headed ``DEMO_TABLE_HEAD``) in ``path``."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(DEMO_TABLE_HEAD))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def test_the_headline_table_is_the_benchmark_docs() -> None:
    # the README quotes the demo table of docs/benchmarks.md: a re-measured table goes into both
    assert demo_table(README) == demo_table(DOCS_DIR / "benchmarks.md")
