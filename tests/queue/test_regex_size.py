"""producer_client.regex_size: a regex's atoms with its counted repetitions unrolled, which the
grammar library's masks cost (tests/e2e/test_structured_outputs.py runs the refusal end to end)."""

import pytest

from producer_client.regex_size import schema_patterns, unrolled_size


@pytest.mark.parametrize(
    ("pattern", "size"),
    [
        ("a{1000000}", 1_000_000),
        ("((a{1000}){1000}){1000}", 1_000_000_000),  # nested repetitions multiply
        ("x{5000}y{5000}", 10_000),  # repetitions one after another add up
        ("[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", 36),
        ("a{2,}", 2),
        ("a{2,700}", 700),
        ("(a|b)*a(a|b){60}", 123),  # *, + and ? repeat once
        (r"a\{1000000\}", 10),  # escaped braces are literal text
        ("[]{]{3}", 3),  # a class's first ] and its braces are characters of it
        ("[^]a]{2}b", 3),
        ("[a-z&&[^x]]{4}", 4),  # a nested class is one atom
        (r"\p{Greek}{10}", 10),
        ("(?P<name>ab){3}(?i:c){2}(?:d){2}", 10),
    ],
)
def test_a_regex_counts_its_atoms_with_its_counted_repetitions_unrolled(pattern, size):
    assert unrolled_size(pattern) == size


def test_a_schemas_patterns_are_its_pattern_values_and_pattern_property_names_not_its_data():
    schema = {
        "type": "object",
        "properties": {"pattern": {"type": "string", "pattern": "a+"}, "b": {"enum": [{"pattern": "data"}]}},
        "patternProperties": {"^x{3}$": {"pattern": "y"}},
        "items": [{"pattern": "z"}],
    }
    assert sorted(schema_patterns(schema)) == [
        (("items", "0", "pattern"), "z"),
        (("patternProperties", "^x{3}$"), "^x{3}$"),
        (("patternProperties", "^x{3}$", "pattern"), "y"),
        (("properties", "pattern", "pattern"), "a+"),
    ]
