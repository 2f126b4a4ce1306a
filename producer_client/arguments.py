"""The command-line parser of MILI's programs (`mili`, the worker, the gateway)."""

from __future__ import annotations

import argparse
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

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: invalid_argument: {message} (see {self.prog} --help)\n")
