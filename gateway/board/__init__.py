"""The queue board at /board: a live web page of every queue, worker, running, waiting and dead
job, and a page per job, served by the gateway from Redis alone (see routes.py)."""

from gateway.board.routes import add_board

__all__ = ["add_board"]
