"""The package's shape: no module imports one that imports it back, and every module says its one job."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "autotune"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Modules of the package that ``path`` imports (type-checking imports count: a cycle of types is
    a cycle of the design)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parents, *([node.module] if node.module else [])])
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        found.update(t for t in targets if t in known and t != name and not name.startswith(t + "."))
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module(p): p for p in PACKAGE.rglob("*.py")}
    known = set(paths)
    return {name: _imports(path, name, known) for name, path in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


DOC = PACKAGE.parent / "docs" / "architecture.md"


def _floors(text: str) -> dict[str, int]:
    """The floor of each module and package the doc's "The floors" lists (``cli.py``, ``load/``,
    ``load/crossing.py``): the lowest floor (highest number) it is named on."""
    section = text.split("## The floors", 1)[1].split("\n## ", 1)[0]
    floors: dict[str, int] = {}
    floor = 0
    for line in section.splitlines():
        numbered = re.match(r"(\d+)\. ", line)
        if numbered:
            floor = int(numbered.group(1))
        for name in re.findall(r"`([\w/]+(?:\.py|/))`", line) if floor else []:
            floors[name] = max(floors.get(name, 0), floor)
    return floors


def _floor(module: str, floors: dict[str, int]) -> int | None:
    """``autotune.load.crossing``'s floor: its own entry (``load/crossing.py``), else its package's
    (``load/``); the package ``autotune`` itself has none."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    own = floors.get("/".join(parts) + ".py")
    return own if own is not None else floors.get(parts[0] + "/")


def _misplaced(graph: dict[str, set[str]], floors: dict[str, int]) -> tuple[list[str], list[str]]:
    """(modules the doc puts on no floor, imports that point up a floor)."""
    missing = sorted(m for m in graph if m != "autotune" and _floor(m, floors) is None)
    up = []
    for name, targets in sorted(graph.items()):
        mine = _floor(name, floors)
        for target in sorted(targets):
            theirs = _floor(target, floors)
            if mine is not None and theirs is not None and theirs < mine:
                up.append(f"{name} (floor {mine}) imports {target} (floor {theirs})")
    return missing, up


def test_every_module_is_on_a_floor_of_the_doc_and_imports_point_down() -> None:
    """docs/architecture.md's floors hold every module of the package, and no import points up them."""
    missing, up = _misplaced(_graph(), _floors(DOC.read_text()))
    assert not missing, f"modules on no floor of {DOC.name}: {missing}"
    assert not up, "imports that point up the floors:\n" + "\n".join(up)


def test_the_floor_check_finds_a_missing_module_and_an_import_up() -> None:
    """The check itself works: the floors read from the doc's list, a module it leaves out, and an import
    from floor 2 to floor 1."""
    floors = _floors("## The floors\n\n1. `cli.py` over\n2. `study/`, `load/` (over `cli.py`)\n## Rules\n")
    assert floors == {"cli.py": 2, "study/": 2, "load/": 2}  # a module named on two floors: the lower
    graph = {
        "autotune.study.loop": {"autotune.cli"},
        "autotune.cli": set(),
        "autotune.load.probe": set(),
        "autotune.x": set(),
    }
    floors = {"cli.py": 1, "study/": 2, "load/": 3}
    assert _misplaced(graph, floors) == (
        ["autotune.x"],
        ["autotune.study.loop (floor 2) imports autotune.cli (floor 1)"],
    )


def test_no_module_imports_one_that_imports_it_back() -> None:
    """Imports point down the floors of docs/architecture.md: the import graph has no cycle."""
    assert _cycle(_graph()) is None


def test_the_checker_finds_a_cycle() -> None:
    """The cycle search itself works (a test that cannot fail proves nothing)."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_every_module_says_its_one_job() -> None:
    """Each module opens with a docstring whose first line says what it is for."""
    missing = [
        str(p.relative_to(PACKAGE.parent))
        for p in PACKAGE.rglob("*.py")
        if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()
    ]
    assert missing == []
