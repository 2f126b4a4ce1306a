"""The job every library runs, and the settings its worker and producer read from the environment
(a worker's CLI imports its app module, so the URL cannot come as an argument)."""

from __future__ import annotations

import os

URL_VARIABLE = "PEERS_REDIS_URL"
POLL_VARIABLE = "PEERS_POLL_S"  # for the libraries that poll: arq's worker and result, taskiq's result
MAX_TOKENS_VARIABLE = "PEERS_MAX_TOKENS"  # MILI's echo jobs only
RESULT_TIMEOUT_S = 60


def echo(prompt: str) -> str:
    """The task's work: a short result from its argument, as MILI's echo job of one token gives
    the prompt's first byte."""
    return prompt[:1]


def redis_url() -> str:
    return os.environ[URL_VARIABLE]


def poll_s() -> float:
    return float(os.environ[POLL_VARIABLE])
