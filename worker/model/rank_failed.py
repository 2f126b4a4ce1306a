"""RankFailed, in a module of its own: the worker's command line catches it, and must not import
torch to do so (its healthcheck runs without it)."""


class RankFailed(BaseException):
    """A rank of the tensor-parallel group died or stopped answering. A BaseException, as
    SystemExit is: it must end the worker, not fail the jobs of the step it interrupted."""

    code = "rank_failed"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
