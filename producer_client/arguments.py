"""The command-line parser of MILI's programs (`mili`, the worker, the gateway)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line, `error: invalid_argument: ...` and exit status 2, as every other
    error of the programs (a subcommand's parser is of this class too): argparse's own printed
    the whole usage block first, forty lines for the worker. No abbreviated long flags: `submit
    --n 2` was taken as `--no-thinking`, a misspelt flag as another one; a flag must be given
    whole, or it is an error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.given: list[str] = []

    # typeshed declares this method as overloads on the namespace's type; one signature serves both
    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self.given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        unknown = self.flags_unknown_before_the_command()
        if unknown and message.startswith("the following arguments are required"):
            # argparse says the missing command first: `mili --bogus` read "the following arguments
            # are required: command", not a word of the flag it did not know.
            message = f"unrecognized arguments: {' '.join(unknown)}"
        self.exit(2, f"error: invalid_argument: {message} (see {self.prog} --help)\n")

    def flags_unknown_before_the_command(self) -> list[str]:
        """The flags given before the first positional argument (a subcommand) that this parser
        does not have, skipping the values of those it has."""
        unknown: list[str] = []
        tokens = iter(self.given)
        for token in tokens:
            if token == "--" or not token.startswith("-") or token == "-" or self._negative_number_matcher.match(token):
                break
            action = self._option_string_actions.get(token.split("=", 1)[0])
            if action is None:
                unknown.append(token)
            elif "=" not in token and action.nargs is None:
                next(tokens, None)  # its value
        return unknown
