"""The Python session of one page, as a user's interpreter in which they paste the page's blocks in
turn: tests/docs/sessions.py runs this file's text with `python -c` (so that, as in a user's
session, the working directory is first on sys.path) and sends it one request per block, a JSON
line {"page", "first_line", "source", "output"}, on the pipe whose fd is its first argument. It runs
the block in the page's one namespace, with fds 1 and 2 on the file `output` (print, tracebacks,
what a child process writes), and answers {"ok": bool} on the pipe of its second argument. The
block is compiled under the page's path, its lines numbered as in the page, so that a traceback
names the page's line and quotes it."""

import json
import os
import sys
import traceback


def run(request: dict, namespace: dict) -> bool:
    code = compile("\n" * (request["first_line"] - 1) + request["source"], request["page"], "exec")
    try:
        exec(code, namespace)
        return True
    except BaseException:  # SystemExit and KeyboardInterrupt too: each is the block's outcome
        kind, error, trace = sys.exc_info()
        traceback.print_exception(kind, error, trace.tb_next)  # from the block's frame, not this one's
        return False


def run_with_output_in(path: str, request: dict, namespace: dict) -> bool:
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as output:
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
        try:
            return run(request, namespace)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def serve() -> None:
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    with os.fdopen(int(sys.argv[1])) as requests, os.fdopen(int(sys.argv[2]), "w", buffering=1) as replies:
        for line in requests:
            request = json.loads(line)
            ok = run_with_output_in(request["output"], request, namespace)
            replies.write(json.dumps({"ok": ok}) + "\n")


serve()
