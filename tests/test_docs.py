"""The README stays a front door and the docs stay connected and current.

README.md: at most 250 lines; its generated performance summary is filled and
dated. Every relative link in README.md and docs/ points at a file that exists.
No source file cites a working-notes version or a path outside the repository.
The repository keeps at most 10 benchmark result files (the latest run per
machine kind).
"""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#[^)]*)?\)")
# Comments that cite working notes, notes versions or machine-local paths.
CITATION = re.compile(r"NOTES(?:\.md)?\b|\bnotes v\d|/work/")
SOURCE_DIRS = ("kvjax", "kernels_pallas", "scripts", "benchmarks", "notebooks", "tests")
SOURCE_SUFFIXES = {".py", ".cc", ".h", ".cpp", ".md", ".toml"}


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; move detail to docs/"


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    missing = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.name} links to missing files: {missing}"


def test_readme_links_every_doc_page():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in DOCS if f"docs/{p.name}" not in readme]
    assert not unlinked, f"README.md does not link {unlinked}"


def test_performance_summary_is_generated_and_dated():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- benchmarks:summary -->\n(.*?)\n<!-- /benchmarks:summary -->", readme,
                  re.S)
    assert m, "README.md lost its generated performance block"
    body = m.group(1)
    assert re.search(r"\d{4}-\d\d-\d\d", body) and "cores" in body, (
        "the summary must name its machine and date: run `python -m benchmarks`")
    assert body.count("\n|") >= 3, "the summary table is empty"


def _sources():
    for d in SOURCE_DIRS:
        for p in (ROOT / d).rglob("*"):
            if p.suffix in SOURCE_SUFFIXES and p.is_file() and "results" not in p.parts:
                yield p


def test_no_source_cites_notes_or_outside_paths():
    bad = []
    for p in _sources():
        rel = p.relative_to(ROOT).as_posix()
        if rel == "tests/test_docs.py":
            continue
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if CITATION.search(line):
                bad.append(f"{rel}:{i}: {line.strip()[:100]}")
    assert not bad, "cite docs/ or the code instead:\n" + "\n".join(bad)


def test_benchmark_results_keep_the_latest_run_per_machine_kind():
    try:
        out = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: tracked files unknown")
    assert len(out) <= 10, f"{len(out)} result files in git: keep the latest per machine kind"
