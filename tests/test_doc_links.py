"""The README and docs/ point only inside the repository: every relative link and image resolves to a file of the
checkout (and an #anchor to a heading of its page), no link climbs out of it (../shared), and no page names an
absolute path of a development machine. Web links (http, https) are allowed only to example hosts."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
MACHINE_PATHS = re.compile(r"(?<![\w.])(/work/|/home/|/root/|/Users/|\.\./shared)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*]", "", heading.strip().lstrip("#").strip()).lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {_anchor(h) for h in re.findall(r"^#{1,6} .*$", text, re.M)}


def test_links_resolve_inside_the_repository():
    bad = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                bad.append(f"{page.name}: {target} (a link out of the repository)")
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.is_relative_to(REPO) or not dest.exists():
                bad.append(f"{page.name}: {target} (no such file in the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.name}: {target} (no such heading in {dest.name})")
    assert not bad, bad


def test_no_machine_paths():
    bad = [f"{p.name}:{i}: {ln.strip()}" for p in PAGES
           for i, ln in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if MACHINE_PATHS.search(ln)]
    assert not bad, bad
