"""Typed errors. Each carries a stable `code`; failed job results use the same codes."""


class MiliError(Exception):
    code = "error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(MiliError):
    """A request argument is out of range or malformed; `field` names it."""

    code = "invalid_argument"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
