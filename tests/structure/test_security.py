"""docs/security.md's list of guarantees: every line states one and names the test that proves
it; each named test exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTION = re.compile(r"^## Security: what holds against hostile and careless users\n(.*?)^## ", re.M | re.S)
TEST = re.compile(r"\(`(tests/[\w/]+\.py)::(test_\w+)`\)$")


def guarantee_lines() -> list[str]:
    section = SECTION.search((ROOT / "docs" / "security.md").read_text())
    assert section, "docs/security.md has no list of guarantees"
    return [line for line in section.group(1).splitlines() if line.startswith("- ")]


def test_every_security_line_names_a_test_that_exists():
    lines = guarantee_lines()
    assert len(lines) >= 20
    for line in lines:
        match = TEST.search(line)
        assert match, f"names no test: {line}"
        path, name = match.groups()
        assert re.search(rf"^(async )?def {name}\(", (ROOT / path).read_text(), re.M), f"{path} has no {name}"
