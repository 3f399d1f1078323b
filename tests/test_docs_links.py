"""Every pointer into the documentation leads somewhere in this repository.

- nothing refers to the original design file (outside the repository, never shipped): no
  "DESIGN §N", no "DESIGN.md";
- every `docs/<file>.md` named in the package, the README, the other docs, the tests, the
  templates and the benchmarks exists;
- every `docs/<file>.md §<section>` names a heading of that file: the words after § are the start
  of a heading (backticks and case ignored) or its number (`docs/timeouts.md §6`). A reference
  ends at `)`, `;`, `:`, `,` or the end of the line, so prose may follow it after one of those;
- relative Markdown links in docs/ and README.md (`[x](checkpoint-core.md#anchor)`) lead to a file
  and, with an anchor, to one of its headings.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DIRS = ("ckptsup", "docs", "tests", "sbatch_templates", "site_config", "examples", "bench")
FILES = ("README.md", "BENCHMARKS.md")
THIS = Path(__file__).resolve()

DESIGN = re.compile(r"DESIGN §|DESIGN\.md")
DOC_PATH = re.compile(r"(?<![\w./-])docs/([\w-]+\.md)")
SECTION_REF = re.compile(r"(?<![\w./-])docs/([\w-]+\.md)`?\s*§\s*([^\n);:,\"|]+)")
MD_LINK = re.compile(r"\]\((?!https?://|mailto:)([^)\s#]*\.md)?(?:#([^)\s]+))?\)")


def text_files() -> list[Path]:
    """The repository's own text files (no virtualenv, caches or binaries; symlinked folders such
    as ckptsup/_data are reached through their real location)."""
    out = [REPO / name for name in FILES if (REPO / name).exists()]
    for top in DIRS:
        for folder, dirs, names in os.walk(REPO / top):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", ".venv", "node_modules") and not d.startswith(".")]
            for name in names:
                path = Path(folder) / name
                if path.suffix in (".png", ".pyc", ".gz", ".so") or path.resolve() == THIS:
                    continue
                out.append(path)
    return sorted(out)


def read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def where(path: Path, text: str, pos: int) -> str:
    return f"{path.relative_to(REPO)}:{text.count(chr(10), 0, pos) + 1}"


def _norm(s: str) -> str:
    return " ".join(s.replace("`", "").lower().split())


def headings(doc: Path) -> list[str]:
    out, fenced = [], False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def section_exists(doc: Path, ref: str) -> bool:
    ref = _norm(ref.rstrip(". "))
    for heading in headings(doc):
        number, _, rest = heading.partition(". ")
        if number.isdigit():
            if ref == number or _norm(rest).startswith(ref):
                return True
        if _norm(heading).startswith(ref):
            return True
    return False


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


FILES_TEXT = [(p, t) for p in text_files() if (t := read(p)) is not None]


def test_the_scan_covers_package_docs_and_readme() -> None:
    scanned = {p.relative_to(REPO).as_posix() for p, _ in FILES_TEXT}
    assert {"README.md", "ckptsup/wire.py", "docs/architecture.md", "sbatch_templates/train.sbatch"} <= scanned


def test_nothing_refers_to_the_design_file_outside_the_repository() -> None:
    found = [f"{where(p, t, m.start())}: {t[m.start():].splitlines()[0][:100]}"
             for p, t in FILES_TEXT for m in DESIGN.finditer(t)]
    assert not found, ("references to DESIGN (not in the repository; point into docs/ instead, e.g. "
                       "'docs/architecture.md §Recovery paths'):\n" + "\n".join(found))


def test_every_docs_path_mentioned_exists() -> None:
    missing = [f"{where(p, t, m.start())}: docs/{m.group(1)}"
               for p, t in FILES_TEXT for m in DOC_PATH.finditer(t) if not (REPO / "docs" / m.group(1)).is_file()]
    assert not missing, "mentions of docs that do not exist:\n" + "\n".join(missing)


def test_every_section_reference_names_a_heading() -> None:
    bad = []
    for path, text in FILES_TEXT:
        for m in SECTION_REF.finditer(text):
            doc, ref = REPO / "docs" / m.group(1), m.group(2).strip()
            if doc.is_file() and not section_exists(doc, ref):
                bad.append(f"{where(path, text, m.start())}: docs/{m.group(1)} §{ref}")
    assert not bad, ("section references without a matching heading (end the section name with "
                     "')', ';', ':' or ',' when prose follows):\n" + "\n".join(bad))


@pytest.mark.parametrize("name", ["README.md"] + sorted(p.name for p in (REPO / "docs").glob("*.md")))
def test_relative_markdown_links_lead_to_a_file_and_heading(name: str) -> None:
    source = REPO / name if name == "README.md" else REPO / "docs" / name
    text = source.read_text(encoding="utf-8")
    bad = []
    for m in MD_LINK.finditer(text):
        target_name, anchor = m.group(1), m.group(2)
        if target_name is None and anchor is None:
            continue
        target = (source.parent / target_name).resolve() if target_name else source
        if not target.is_file():
            bad.append(f"{where(source, text, m.start())}: {target_name} does not exist")
        elif anchor and anchor not in {github_anchor(h) for h in headings(target)}:
            bad.append(f"{where(source, text, m.start())}: no heading #{anchor} in {target.name}")
    assert not bad, "\n".join(bad)


def test_section_matching_rules() -> None:
    doc = REPO / "docs" / "timeouts.md"
    assert section_exists(doc, "6") and section_exists(doc, "Requeue and the watchdog")
    assert not section_exists(doc, "7") and not section_exists(doc, "Watchdog")
    assert section_exists(REPO / "docs" / "planning.md", "`ckptsup plan`")
    assert github_anchor("Node-local cache (`local_cache.py`)") == "node-local-cache-local_cachepy"
