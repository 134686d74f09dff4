"""The docs stay complete: every setting in docs/configuration.md, every error in docs/troubleshooting.md."""

import ast
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Dict, List, Tuple

import gradian_lightning
from gradian_lightning import errors
from gradian_lightning.config import GradianConfig

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(gradian_lightning.__file__).parent
MIN_FRAGMENT = 6  # constant pieces shorter than this ("', ", "): ") say nothing on their own


def setting_keys(cls=GradianConfig, prefix="") -> List[str]:
    """Every dotted config key, walking the dataclasses; dict fields (trainer) as `trainer.*` plus their defaults."""
    keys = []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += setting_keys(type(default), key + ".")
        elif isinstance(default, dict):
            keys += [key + ".*"] + [f"{key}.{k}" for k in default]
        else:
            keys.append(key)
    return keys


def error_types() -> Dict[str, type]:
    return {
        name: obj for name, obj in vars(errors).items() if inspect.isclass(obj) and issubclass(obj, errors.GradianError)
    }


def _fragments(message: ast.expr) -> List[str]:
    """The constant text of a message, split where values are formatted in."""
    parts = message.values if isinstance(message, ast.JoinedStr) else [message]
    out = []
    for part in parts:
        if isinstance(part, ast.Constant) and isinstance(part.value, str):
            out += [p.strip() for p in re.split(r"\{[^}]*\}", part.value)]
    return [f for f in out if len(f) >= MIN_FRAGMENT]


def _call_name(call: ast.Call) -> str:
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "?")


def _trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(ROOT)), ast.parse(path.read_text())


def constructed_errors() -> List[Tuple[str, str, int, List[str]]]:
    """(exception name, file, line, constant message fragments) for every GradianError made in the package."""
    types = error_types()
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _call_name(node) in types:
                found.append((_call_name(node), path, node.lineno, _fragments(node.args[0]) if node.args else []))
    return found


def raises_of_other_types() -> List[Tuple[str, str, int]]:
    """`raise X(...)` where X is neither a GradianError nor a function that returns one."""
    types = error_types()
    makers = set()
    for _, tree in _trees():
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef):
                returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
                if returns and all(isinstance(r.value, ast.Call) and _call_name(r.value) in types for r in returns):
                    makers.add(fn.name)
    offenders = []
    for path, tree in _trees():
        # The sequence protocol: `__getitem__` ends iteration with IndexError, never shown to a user.
        protocol = {
            id(node)
            for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef) and fn.name == "__getitem__"
            for node in ast.walk(fn)
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and _call_name(node.exc) == "IndexError"
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Raise) and node.exc is not None and id(node) not in protocol
            ):  # bare `raise` re-raises
                name = _call_name(node.exc) if isinstance(node.exc, ast.Call) else ast.unparse(node.exc)
                # Ctrl-C handed on to cli.py (out of Lightning's SystemExit), which says what was kept: not an error.
                if name not in types and name not in makers and name != "KeyboardInterrupt":
                    offenders.append((name, path, node.lineno))
    return offenders


def test_every_setting_has_an_entry():
    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = {m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", page, flags=re.M)}
    missing = [k for k in setting_keys() if k not in rows]
    assert not missing, f"docs/configuration.md has no table row for {missing}"
    for key in setting_keys():
        if not key.endswith(".*"):
            row = re.search(rf"^\| `{re.escape(key)}` \|(.*)$", page, flags=re.M).group(1)
            cells = [c.strip() for c in row.split("|")]
            assert len(cells) >= 5 and all(cells[:4]), (
                f"{key}: type, default, allowed values and effect must all be filled in"
            )


def test_every_error_type_and_message_has_an_entry():
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    for name in error_types():
        assert f"`{name}`" in page, f"docs/troubleshooting.md does not describe {name}"
    missing = []
    for name, path, line, fragments in constructed_errors():
        missing += [f"{path}:{line} {name}: {f!r}" for f in fragments if f not in page]
    assert not missing, "docs/troubleshooting.md lacks these error texts:\n" + "\n".join(missing)


def test_every_raised_error_is_a_gradian_error():
    """User-facing errors derive from GradianError; a bare `raise` (re-raising what was caught) is fine."""
    offenders = raises_of_other_types()
    assert not offenders, f"these raise something that is not a GradianError: {offenders}"


def test_safety_section_states_the_three_promises():
    page = (ROOT / "docs" / "configuration.md").read_text()
    safety = page[page.index("## Safety") :]
    assert "model.trust_remote_code" in safety and "weights_only=True" in safety and "index.path" in safety


def documented_rows(section: str) -> Dict[str, str]:
    """{key: default as written} of the `section.*` rows of docs/configuration.md's tables."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = re.findall(rf"^\| `{section}\.(\w+)` \| [^|]+ \| `([^`]*)`", text, flags=re.M)
    return dict(rows)


def test_the_grads_and_query_rows_of_the_docs_are_the_spec_fields_with_their_defaults():
    """The docs' grads.* rows are IndexSpec's fields plus the data keys, its query.* rows QuerySpec's
    plus the run keys: a field added to a spec without its row, or a row whose default is not the
    spec's, fails here."""
    import yaml

    from gradian_lightning.config import GradsData, QueryRun
    from gradian_lightning.specs import IndexSpec, QuerySpec

    for section, spec, extra in (("grads", IndexSpec, GradsData), ("query", QuerySpec, QueryRun)):
        rows = documented_rows(section)
        assert set(rows) == {f.name for f in dataclasses.fields(spec)} | {f.name for f in dataclasses.fields(extra)}
        for f in dataclasses.fields(spec):
            default = list(f.default) if isinstance(f.default, tuple) else f.default
            written = yaml.safe_load(rows[f.name])  # the docs write YAML values
            assert written == default, (
                f"docs/configuration.md: {section}.{f.name} defaults to {default!r}, not {rows[f.name]}"
            )
