"""The tests' own layering: fixtures shared across packages come from tests/support through
`pytest_plugins` in the top-level conftest, so no module imports from a conftest and no conftest
imports a fixture to hand it on (pytest would not see where it came from, and linters flag it)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def source_files() -> list[Path]:
    return sorted(TESTS.rglob("*.py"))


def imported_from(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(module, names) of each `from X import names` anywhere in the tree."""
    return [(n.module or "", [a.name for a in n.names]) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]


def fixtures_defined_in(path: Path) -> set[str]:
    def is_fixture(decorator: ast.expr) -> bool:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return isinstance(target, ast.Attribute) and target.attr == "fixture"

    tree = ast.parse(path.read_text())
    return {
        n.name for n in tree.body if isinstance(n, ast.FunctionDef) and any(is_fixture(d) for d in n.decorator_list)
    }


def module_path(module: str) -> Path | None:
    path = TESTS.parent / Path(*module.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else None


def test_no_module_imports_from_a_conftest():
    offenders = [
        f"{path.relative_to(TESTS)}: from {module}"
        for path in source_files()
        for module, _ in imported_from(ast.parse(path.read_text()))
        if module.split(".")[-1] == "conftest"
    ]
    assert offenders == []


def test_no_conftest_imports_a_fixture_to_hand_it_on():
    offenders = []
    for conftest in TESTS.rglob("conftest.py"):
        for module, names in imported_from(ast.parse(conftest.read_text())):
            source = module_path(module) if module.startswith("tests.") else None
            handed_on = set(names) & fixtures_defined_in(source) if source else set()
            offenders += [f"{conftest.relative_to(TESTS)}: {name} from {module}" for name in sorted(handed_on)]
    assert offenders == []


def declares_plugins(path: Path) -> bool:
    assigned = [t for n in ast.parse(path.read_text()).body if isinstance(n, ast.Assign) for t in n.targets]
    return any(isinstance(t, ast.Name) and t.id == "pytest_plugins" for t in assigned)


def test_shared_fixtures_are_plugins_of_the_top_level_conftest_only():
    assert [path.relative_to(TESTS) for path in source_files() if declares_plugins(path)] == [Path("conftest.py")]
