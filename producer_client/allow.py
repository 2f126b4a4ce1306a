"""The Allow header of MILI's HTTP endpoints (the gateway's, a worker's metrics): each answers HEAD
wherever it answers GET (RFC 9110 9.3.2), so an Allow that names GET names HEAD too (15.5.6: it
lists every method the resource answers), whatever their frameworks listed. Imported by those
programs only: the one layer both import."""

from __future__ import annotations


def with_head(allow: str) -> str:
    """An Allow header's value, naming HEAD beside GET where it names GET without HEAD."""
    allowed = [method.strip() for method in allow.split(",") if method.strip()]
    if "GET" in allowed and "HEAD" not in allowed:
        return ", ".join([*allowed, "HEAD"])
    return allow
