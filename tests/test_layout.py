"""The package's imports point one way: no circles, and the boundaries the package docstring draws hold.

Imports are read with `ast` from the source, including those inside functions, so a lazy import
cannot hide a circle.
"""

import ast
from pathlib import Path
from typing import Dict, List, Set

import gradian_lightning

PACKAGE = Path(gradian_lightning.__file__).parent
ROOT = "gradian_lightning"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: Set[str]) -> Set[str]:
    """Every module imported by the file, absolute names; gradian_lightning ones resolved to modules."""
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from gradian_lightning.x import y` imports the module x.y when y is one.
            found.update(
                f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in modules
            )
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: use absolute imports (line {node.lineno})")
    return found


def graph() -> Dict[str, Set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in files.items():
        edges[name] = {m for m in imports_of(path, set(files)) if m in files and m != name}
    return edges


def find_cycle(edges: Dict[str, Set[str]]) -> List[str]:
    """One import circle as [a, b, ..., a], or [] when there is none (depth-first search)."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    stack: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_find_cycle_reports_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_circles():
    cycle = find_cycle(graph())
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_boundaries():
    """The gradient path is plain torch; the store knows nothing of scoring, Lightning or the data reader."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    for name, path in files.items():
        imported = imports_of(path, set(files))
        tops = {m.split(".")[0] for m in imported}
        if name.startswith(f"{ROOT}.gradients"):
            assert not tops & {"lightning", "zarr"}, f"{name} imports {tops & {'lightning', 'zarr'}}"
            assert not {m for m in imported if m.startswith((f"{ROOT}.index", f"{ROOT}.query", f"{ROOT}.recipes"))}, (
                name
            )
        if name.startswith(f"{ROOT}.index"):
            assert "lightning" not in tops, f"{name} imports lightning"
            above = (f"{ROOT}.query", f"{ROOT}.recipes", f"{ROOT}.callback", f"{ROOT}.data_sources")
            assert not {m for m in imported if m.startswith(above)}, name  # the store reads no data source
        if not name.startswith((f"{ROOT}.recipes", f"{ROOT}.cli")) and name != ROOT:
            assert not {m for m in imported if m.startswith((f"{ROOT}.recipes", f"{ROOT}.cli"))}, (
                f"{name} imports a recipe or the CLI"
            )


def test_the_settings_objects_and_the_adapter_sit_where_the_docstring_says():
    """specs.py is bottom: every layer may read the settings, and they import nothing of gradian's
    but its errors. The Lightning adapter maps hooks onto an IndexSession: it scores nothing."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    specs = {m for m in imports_of(PACKAGE / "specs.py", set(files)) if m.startswith(ROOT)}
    assert specs <= {f"{ROOT}.errors"}, specs
    adapter = {m for m in imports_of(PACKAGE / "callback.py", set(files)) if m.startswith(ROOT)}
    assert f"{ROOT}.index.session" in adapter
    assert not {m for m in adapter if m.startswith((f"{ROOT}.query", f"{ROOT}.recipes", f"{ROOT}.gradients"))}, adapter
    # The Hugging Face adapter maps the Trainer's events onto the same session, without Lightning.
    hf = imports_of(PACKAGE / "hf_callback.py", set(files))
    assert f"{ROOT}.index.session" in hf and "lightning" not in {m.split(".")[0] for m in hf}, hf
    assert not {m for m in hf if m.startswith((f"{ROOT}.query", f"{ROOT}.recipes", f"{ROOT}.callback"))}, hf
