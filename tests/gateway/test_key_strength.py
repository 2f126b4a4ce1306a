"""The estimate of a key's entropy (gateway/key_strength.py): keys made by people (words,
separators, years, repeats, sequences) fall under 128 bits; keys of 32 random bytes, written in
hex or base64, never do; the start-up warning names a weak key by its place, never the key."""

from __future__ import annotations

import base64
import logging
import math
import random

import pytest

from gateway.api_keys import tenant_id
from gateway.key_strength import STRONG_BITS, alphabet_size, entropy_bits, warn_of_weak_keys

MADE_BY_PEOPLE = [
    "",
    "tenant-a-key",
    "changeme",
    "password1234567890",
    "Tr0ub4dor&3",
    "correct-horse-battery-staple",
    "my-super-secret-production-key-2024",
    "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789",
    "a" * 64,
    "1234567890" * 5,
]


@pytest.mark.parametrize("key", MADE_BY_PEOPLE)
def test_a_key_made_by_a_person_is_under_128_bits(key):
    assert entropy_bits(key) < STRONG_BITS


def random_keys(count: int) -> list[str]:
    """32 random bytes (seeded: the same keys every run) in each encoding generators write."""
    rng = random.Random(20240607)
    keys = []
    for _ in range(count):
        raw = rng.randbytes(32)
        keys += [raw.hex(), raw.hex().upper(), base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()]
    return keys


def test_keys_of_32_random_bytes_are_never_under_128_bits():
    lowest = min(entropy_bits(key) for key in random_keys(500))
    assert lowest >= STRONG_BITS + 32  # a margin: the estimate errs low, but not by a quarter


def test_the_alphabet_is_the_classes_a_key_uses_and_its_other_characters():
    assert alphabet_size("0123") == 10
    assert alphabet_size("deadbeef01") == alphabet_size("DEADBEEF01") == 16
    assert alphabet_size("abcxyz") == 26
    assert alphabet_size("aZ9") == 62
    assert alphabet_size("aZ9-_-") == 64
    assert alphabet_size("a b") == 27


def test_a_run_costs_its_first_character_direction_and_length():
    assert entropy_bits("z" * 64) == pytest.approx(math.log2(26) + math.log2(3) + math.log2(64))
    assert entropy_bits("a" * 64) == pytest.approx(math.log2(16) + math.log2(3) + math.log2(64))  # hex digits
    assert entropy_bits("9876") == pytest.approx(math.log2(10) + math.log2(3) + math.log2(4))


def test_a_word_costs_at_most_twenty_bits_and_a_separator_used_again_one():
    assert entropy_bits("production") == 20.0
    assert entropy_bits("key") == pytest.approx(3 * math.log2(26))
    bits_per_char = math.log2(27)
    assert entropy_bits("production-production-production") == pytest.approx(3 * 20.0 + bits_per_char + 1.0)


def test_the_warning_names_each_weak_key_by_its_place_and_never_the_key(caplog):
    strong = base64.urlsafe_b64encode(random.Random(1).randbytes(32)).decode()
    with caplog.at_level(logging.WARNING, logger="gateway"):
        warn_of_weak_keys([strong, "tenant-a-key"], ["admin-key", strong])
    assert [r.getMessage().split(" can be guessed")[0] for r in caplog.records] == ["api_keys[1]", "admin_api_keys[0]"]
    for secret in (strong, "tenant-a-key", "admin-key", tenant_id("tenant-a-key"), tenant_id("admin-key")):
        assert secret not in caplog.text
