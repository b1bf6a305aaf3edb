"""The README's layout section names every module, so that it keeps matching the tree."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "slotkeeper"


def _layout() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("src/slotkeeper/\n")
    return readme[start:readme.index("\ntests/", start)]


def test_every_module_is_in_the_readme_layout() -> None:
    layout = _layout()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if path.name in ("__init__.py", "__main__.py") or relative.parts[0] == "tinymodel":
            continue  # a package is named by its directory; tinymodel/ is described as a whole
        if path.name.endswith("_routes.py") and "*_routes.py" in layout:
            continue
        if path.name not in layout:
            missing.append(str(relative))
    assert not missing, f"modules the README's layout section does not name: {missing}"


def test_the_layout_names_no_module_that_is_gone() -> None:
    layout = _layout()
    names = {path.name for path in PACKAGE.rglob("*.py")}
    named = {word.strip("(),:;`") for word in layout.split()
             if word.strip("(),:;`").endswith(".py") and "*" not in word}
    gone = sorted(n.rsplit("/", 1)[-1] for n in named if n.rsplit("/", 1)[-1] not in names)
    assert not gone, f"the README's layout section names modules that do not exist: {gone}"
