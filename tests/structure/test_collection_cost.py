"""What collecting the tests costs: every pytest process collects before its first test (scripts/test.sh
starts four on the whole tree, each GPU stage's rehearsal one per pytest step), so no module of
tests/ or harness/ imports transformers or peft at its top. Their model classes took 4.5 s of CPU
of the tree's 12 s collection (`python -m pytest --collect-only tests`: 12 s -> 7.5 s user+sys
without them); the tests that compare with transformers import it in their own fixture or body."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COLLECTED = ("tests", "harness")
REFERENCE_ONLY = {"transformers", "peft"}


def module_level_imports(path: Path) -> set[str]:
    """The top-level names of the packages that `path` imports when it is imported: its statements
    outside functions and classes, those under a module-level if/try/with included."""
    found = set()
    pending = list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            pending += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
            pending += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
    return found


def test_module_level_imports_reads_only_what_importing_runs(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import a.b\nfrom c import d\nif x:\n    import e\ntry:\n    pass\nexcept E:\n    from f import g\n"
        "def h():\n    import i\nclass J:\n    def k(self):\n        from l import m\n"
    )
    assert module_level_imports(module) == {"a", "c", "e", "f"}


def test_no_module_the_collection_imports_imports_transformers_or_peft_at_its_top():
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for folder in COLLECTED
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in sorted(module_level_imports(path) & REFERENCE_ONLY)
    ]
    assert wrong == []
