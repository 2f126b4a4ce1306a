"""Who may see the board: with `api_keys` set, the admin keys where there are any, else every key
(routes.board_keys). A tenant's key where admin keys are set is a right key without the right: a
403 that says the board needs an admin key (RFC 9110 15.5.4), not the 401 of a wrong key.

A browser cannot send an `Authorization: Bearer` header when it follows a link, and a key in the
URL would end up in histories, logs and Referer headers. So the board has a login form: the key
is posted once, and the answer sets a session cookie that is *signed with that key* (HMAC-SHA256
of its expiry), not the key itself. Every gateway with the same keys accepts it, with no state
shared between them; removing a key from `api_keys` ends its sessions; a stolen cookie is worth
SESSION_S at most and never reveals the key. The cookie is HttpOnly (no script reads it) and
SameSite=Strict (no other site's page sends it). Board actions (retry, purge, cancel) also need the
X-MILI-Board header, which a page of another origin cannot add without a CORS preflight that the
gateway refuses: this also guards an open board (no api_keys) on localhost against a drive-by POST.
Scripts may use the board's routes with the Bearer header, as the API's."""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Callable, Sequence

from starlette.requests import Request

from gateway.api_keys import bearer_key, key_matches

COOKIE = "mili_board_session"
SESSION = re.compile(r"[0-9]{1,12}\.[0-9a-f]{64}")  # expiry, then HMAC-SHA256 in hex
SESSION_S = 12 * 3600
ACTION_HEADER = "x-mili-board"


class BoardAuth:
    def __init__(self, api_keys: list[str], clock: Callable[[], float] = time.time, tenant_keys: Sequence[str] = ()):
        self.keys = [k.encode() for k in api_keys]
        self.tenant_keys = [k.encode() for k in tenant_keys]  # the gateway's keys the board lets not in
        self.clock = clock

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def session_for(self, key: str) -> str | None:
        """The cookie's value for a correct key, else None."""
        if not key_matches(key, self.keys):
            return None
        expires = int(self.clock()) + SESSION_S
        return f"{expires}.{_sign(key.encode(), expires)}"

    def allows(self, request: Request) -> bool:
        if not self.required:
            return True
        bearer = bearer_key(request)
        if bearer is not None:
            return key_matches(bearer, self.keys)
        return self.session_valid(request.cookies.get(COOKIE, ""))

    def is_tenant_key(self, key: str | None) -> bool:
        """Whether `key` is one of the gateway's keys that the board does not let in (a tenant's)."""
        return key is not None and key_matches(key, self.tenant_keys)

    def session_valid(self, cookie: str) -> bool:
        """Any cookie a browser may send (not ASCII, no dot, digits of other scripts) is valid
        or not: never an error."""
        if not SESSION.fullmatch(cookie):
            return False
        expires, _, signature = cookie.partition(".")
        if int(expires) <= self.clock():
            return False
        matches = [hmac.compare_digest(signature.encode(), _sign(k, int(expires)).encode()) for k in self.keys]
        return any(matches)


def _sign(key: bytes, expires: int) -> str:
    return hmac.new(key, f"mili-board-session:{expires}".encode(), hashlib.sha256).hexdigest()
