"""The table of error codes in docs/failure-semantics.md lists every code the code base raises or
ends a job with: the `code` of each MiliError subclass, each with its meaning and whether retrying
helps."""

from __future__ import annotations

import ast
import re

import pytest

import producer_client
from producer_client import errors
from tests.structure.test_layers import ROOT, modules


def codes_in_the_code() -> dict[str, str]:
    """{code: module} for every class-level `code = "..."` in our packages."""
    found = {}
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    if (
                        isinstance(statement, ast.Assign)
                        and [getattr(t, "id", None) for t in statement.targets] == ["code"]
                        and isinstance(statement.value, ast.Constant)
                        and isinstance(statement.value.value, str)
                    ):
                        found[statement.value.value] = module
    return found


def codes_in_the_docs() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "failure-semantics.md").read_text()
    section = re.search(r"^## Error codes\n(.*?)(?=^## |\Z)", text, re.M | re.S).group(1)
    return {
        m[0]: [c.strip() for c in m[1:]] for m in re.findall(r"^\| `(\w+)` \|(.*?)\|(.*?)\|(.*?)\|$", section, re.M)
    }


def test_the_docs_list_every_error_code_and_only_those():
    assert sorted(codes_in_the_docs()) == sorted(codes_in_the_code())


def test_every_listed_code_says_where_what_and_whether_to_retry():
    for code, (where, meaning, retry) in codes_in_the_docs().items():
        assert where and len(meaning) > 20 and retry, code


def test_every_error_class_the_docs_name_is_importable_from_the_package():
    """A user catches what the pages name as they import the client: `from producer_client import
    NotReplicated` (operations.md's wait_replicas) raised ImportError while every other typed error
    came from there; ShardCountMismatch (architecture.md's shards) neither."""
    pages = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    classes = [
        name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, errors.MiliError)
    ]
    named = [name for name in classes if re.search(rf"`{name}`", pages)]
    assert "NotReplicated" in named and "QueueFull" in named
    assert [name for name in named if name not in producer_client.__all__] == []


@pytest.mark.parametrize(
    ("error", "procedure"),
    [
        (errors.ShardCountMismatch("q", asked=2, stored=3), "HDEL mili:sched:{queue} shards"),
        (errors.InvalidShardCount("q", stored="x", most=64), "the field `shards` of `mili:sched:{queue}`"),
    ],
)
def test_an_error_that_sends_the_operator_to_a_page_names_the_section_that_says_what_to_do(error, procedure):
    """ShardCountMismatch and InvalidShardCount said to change a queue's count as
    docs/operating-the-queue.md says, a page with no word of shards: the procedure is in
    architecture.md's section on them."""
    page, section = re.search(r"docs/([a-z-]+\.md), '([^']+)'", error.message).groups()
    text = (ROOT / "docs" / page).read_text()
    body = re.search(rf"^#+ {re.escape(section)}\n(.*?)(?=^#+ |\Z)", text, re.M | re.S)
    assert body is not None, (page, section)
    assert procedure in body.group(1)
