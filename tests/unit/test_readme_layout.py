"""The README's layout section follows the tree: each folder's entry names the modules in that folder, the root
modules are named in the entry of the root, and it names no module that is gone."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "slotkeeper"


def _layout() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("src/slotkeeper/ ")
    return readme[start:readme.index("\ntests/", start)]


def entries(layout: str) -> dict[str, str]:
    """The layout's entries: a line indented by two spaces opens one (its first word: `cache/`, `config.py`), and the
    lines indented deeper continue it."""
    found: dict[str, str] = {}
    current = None
    for line in layout.splitlines()[1:]:
        if line.startswith("  ") and not line.startswith("   "):
            current = line.split()[0]
            found[current] = line
        elif current is not None:
            found[current] += "\n" + line
    return found


def _named(text: str) -> set[str]:
    return {word.strip("(),:;`") for word in text.split()}


def test_each_module_is_named_in_its_folders_entry() -> None:
    blocks = entries(_layout())
    root_entry = " ".join(text for name, text in blocks.items() if name.endswith(".py"))
    misplaced = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if path.name in ("__init__.py", "__main__.py") or relative.parts[0] == "tinymodel":
            continue  # a package is named by its directory; tinymodel/ is described as a whole
        text = root_entry if len(relative.parts) == 1 else blocks.get(relative.parts[0] + "/", "")
        inner = str(relative.relative_to(relative.parts[0])) if len(relative.parts) > 2 else relative.name
        named = _named(text)
        if path.name.endswith("_routes.py") and "*_routes.py" in named:
            continue
        if path.name not in named and inner not in named and not any(n.endswith("/" + path.name) for n in named):
            misplaced.append(str(relative))
    assert not misplaced, f"modules the README's layout does not name in their folder's entry: {misplaced}"


def test_every_folder_has_an_entry() -> None:
    blocks = entries(_layout())
    folders = {p.name + "/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders - set(blocks) == set()
    assert {b for b in blocks if b.endswith("/")} - folders == set()


def test_the_layout_names_no_module_that_is_gone() -> None:
    layout = _layout()
    names = {path.name for path in PACKAGE.rglob("*.py")}
    named = {word for word in _named(layout) if word.endswith(".py") and "*" not in word}
    gone = sorted(n.rsplit("/", 1)[-1] for n in named if n.rsplit("/", 1)[-1] not in names)
    assert not gone, f"the README's layout section names modules that do not exist: {gone}"


def test_a_misplaced_module_is_found() -> None:
    blocks = entries("src/slotkeeper/\n  cache/  pool.py (slots)\n  web/    app.py,\n          store.py\n")
    assert "store.py" in _named(blocks["web/"]) and "store.py" not in _named(blocks["cache/"])
