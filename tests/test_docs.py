"""README.md leads with use and links every page under docs/; every relative link of the README
and the pages resolves; the README's first example runs and prints what its comments say."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _pages() -> list:
    return sorted(os.path.join(DOCS, n) for n in os.listdir(DOCS) if n.endswith(".md"))


def _first_python_block(text: str):
    """(line number where the block's code starts, its code)."""
    start = text.index("```python\n") + len("```python\n")
    return text[:start].count("\n") + 1, text[start:text.index("```", start)]


def test_readme_is_short_and_leads_with_code():
    text = _read(README)
    assert len(text.splitlines()) <= 250
    line, _ = _first_python_block(text)
    assert line <= 40, f"the first example starts at line {line}"


def test_readme_links_every_docs_page():
    linked = {os.path.normpath(os.path.join(ROOT, t)) for t in LINK.findall(_read(README))}
    missing = [os.path.relpath(p, ROOT) for p in _pages() if p not in linked]
    assert not missing, f"README.md links none of {missing}"


def test_relative_links_resolve():
    broken = []
    for path in [README, *_pages()]:
        for target in LINK.findall(_read(path)):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.join(os.path.dirname(path), target)):
                broken.append(f"{os.path.relpath(path, ROOT)} -> {target}")
    assert not broken, broken


def test_readme_example_runs():
    """The first example, as a user pastes it, on the emulation backend (as on any CPU)."""
    _, code = _first_python_block(_read(README))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "FP8OPS_FORCE_EMULATION": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "FP8Linear"
    assert lines[1].startswith("emulation - "), lines
