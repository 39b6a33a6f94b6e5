"""The docs' relative links resolve from a clone, and the design notes the code cites are in it."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def _tracked_markdown() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.split() if not p.startswith("results/")]  # REPORT.md: tested by reproduce


def test_every_relative_link_in_the_docs_resolves():
    docs = _tracked_markdown()
    assert ROOT / "README.md" in docs
    broken = []
    for doc in docs:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            if not (doc.parent / target.split("#")[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_the_design_notes_the_code_cites_are_in_the_repository():
    for name in ("DESIGN.md", "PAPER.md"):
        cited = subprocess.run(["git", "grep", "-l", name, "--", "*.py"], cwd=ROOT, capture_output=True, text=True)
        assert cited.stdout.strip(), name  # still cited, so it must resolve
        assert (ROOT / "docs" / name).is_file(), name
