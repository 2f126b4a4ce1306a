"""How hard an API key is to guess, estimated from the key itself: the gateway warns at start-up
about a key under STRONG_BITS.

No limit on failed attempts protects a key (gateway.api_keys.AuthFailures never refuses a right
one), and a key's tenant id, a 48-bit digest of it, shows in the ids of the jobs it sends with an
Idempotency-Key: a key must hold out against guessing online and offline by itself. 128 bits do,
at any rate of guessing.

The estimate charges a key for what it would cost to make it the way a person makes one:
- a character costs log2 of its alphabet: the classes of characters the key uses (digits,
  lowercase, uppercase; the 16 hex digits for a key of hex digits only, as `openssl rand -hex`
  writes) and each other character it holds;
- a word (3 letters or more: lowercase, UPPER or Capitalized) costs at most WORD_BITS;
- a run of RUN_MIN characters or more one step apart (aaaa, abcd, 4321) costs its first
  character, its direction and its length;
- a separator (neither letter nor digit) the key has used before costs a bit.
A key of random characters is charged a little less than it holds (some runs of its letters look
like words); a key made of words, separators and years is charged about what a guesser who knows
those habits would need. `secrets.token_urlsafe(32)` (256 bits) is far above the line, and so is
any key of 32 random bytes, written in hex or base64."""

from __future__ import annotations

import logging
import math
import re
import string

STRONG_BITS = 128
WORD_BITS = 20.0  # a choice among a million words: every English word, each in its common spellings
RUN_MIN = 4

CLASSES = (string.digits, string.ascii_lowercase, string.ascii_uppercase)
ALPHANUMERIC = frozenset(string.digits + string.ascii_letters)
HEX = re.compile(r"[0-9a-f]+|[0-9A-F]+")
WORD = re.compile(r"[a-z]{3,}|[A-Z][a-z]{2,}|[A-Z]{3,}")

log = logging.getLogger("gateway")


def alphabet_size(key: str) -> int:
    """How many characters a key of this shape is drawn from."""
    if HEX.fullmatch(key) and not key.isdigit():
        return 16
    used = sum(len(chars) for chars in CLASSES if any(c in chars for c in key))
    return used + len(set(key) - ALPHANUMERIC)


def run_length(key: str, start: int) -> int:
    """The length of the run of characters one step apart (the same step) from `start`."""
    if start + 1 >= len(key):
        return 1
    step = ord(key[start + 1]) - ord(key[start])
    if step not in (-1, 0, 1):
        return 1
    end = start + 1
    while end + 1 < len(key) and ord(key[end + 1]) - ord(key[end]) == step:
        end += 1
    return end - start + 1


def entropy_bits(key: str) -> float:
    """The bits a guesser who knows how people make keys must search (the module's docstring)."""
    char_bits = math.log2(max(alphabet_size(key), 1))
    bits = 0.0
    seen: set[str] = set()
    at = 0
    while at < len(key):
        run = run_length(key, at)
        word = WORD.match(key, at)
        if run >= RUN_MIN:
            bits += char_bits + math.log2(3) + math.log2(run)
            length = run
        elif word is not None:
            length = word.end() - at
            bits += min(length * char_bits, WORD_BITS)
        else:
            length = 1
            bits += 1.0 if key[at] in seen and key[at] not in ALPHANUMERIC else char_bits
        seen.update(key[at : at + length])
        at += length
    return bits


def warn_of_weak_keys(api_keys: list[str], admin_api_keys: list[str]) -> None:
    """One warning per key under STRONG_BITS, naming it by its place in the settings: never the
    key, nor its tenant id, a digest from which a weak key is found offline."""
    for setting, keys in (("api_keys", api_keys), ("admin_api_keys", admin_api_keys)):
        for place, key in enumerate(keys):
            bits = entropy_bits(key)
            if bits < STRONG_BITS:
                log.warning(
                    "%s[%d] can be guessed: about %d bits of entropy, under %d; make keys of 32 random bytes, "
                    "such as python -c 'import secrets; print(secrets.token_urlsafe(32))' (docs/security.md)",
                    setting,
                    place,
                    bits,
                    STRONG_BITS,
                )
