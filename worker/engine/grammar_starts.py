"""The requests whose grammar is compiling (on the compile thread): each starts once its grammar
has compiled, and until then the scheduler leaves it waiting (Request.ready)."""

from __future__ import annotations

import logging

from worker.engine.outputs import RequestError, RequestOutput
from worker.engine.reader import StepReader
from worker.engine.request import Request
from worker.engine.scheduler import Scheduler

log = logging.getLogger(__name__)

# How long a step with nothing to run waits for a grammar being compiled, instead of returning
# at once to a caller that would call again straight away.
COMPILE_WAIT_S = 0.005


class GrammarStarts:
    def __init__(self, scheduler: Scheduler, reader: StepReader):
        self.scheduler = scheduler
        self.reader = reader
        self.compiling: list[Request] = []  # requests whose grammar has not started yet

    def add(self, req: Request) -> None:
        self.compiling.append(req)

    def start_compiled(self, outputs: list[RequestOutput]) -> None:
        """Requests whose grammar compiled since the last step can be admitted now; one whose
        grammar did not compile ends with the error, and one resumed with tokens that complete
        its grammar ends as "stop"."""
        compiling = []
        for req in self.compiling:
            if req.is_finished:
                continue  # aborted while it compiled
            if not req.grammar.compiled:
                compiling.append(req)
                continue
            error = req.grammar.start()
            if error is not None:
                self.scheduler.abort(req.request_id)
                req.finish("error", RequestError(error.code, error.message))
                log.info("request %s: its grammar does not compile: %s", req.request_id, error.message)
                outputs.append(self.reader.end(req, req.text.finish(), []))
            elif req.grammar.complete:
                outputs.append(self.reader.end_by_grammar(req))  # resumed after its output was whole
        self.compiling = compiling

    def wait_a_little(self) -> None:
        """Waits up to COMPILE_WAIT_S for the oldest grammar still compiling."""
        self.compiling[0].grammar.wait_compiled(COMPILE_WAIT_S)
