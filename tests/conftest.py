"""Session-wide setup: the shared fixtures, the tiers' markers and the device tests' (tests/support/fixtures.py,
tiers.py and devices.py, through `pytest_plugins`, which pytest reads only in this top-level conftest), and
Triton's interpreter mode, chosen before anything imports triton.

triton.jit decides compiled-or-interpreted when a function is defined, that is when
triton.language (whose tl.sum, tl.max... are jit functions too) and kernels/ are imported.
Without CUDA the kernel tests need interpreted kernels, while every other test must keep
the torch reference path, which kernels.use_triton picks whenever TRITON_INTERPRET is unset
at call time (and worker processes that tests spawn inherit the environment). So both are
imported here once with the variable set, and it is unset again; tests/kernels sets it per
test. A variable set by the caller is left alone.
"""

import atexit
import gc
import os

import pytest
import torch

pytest_plugins = ["tests.support.fixtures", "tests.support.tiers", "tests.support.devices"]

# Under pytest-xdist (scripts/test.sh) each process takes its share of the cores for torch's
# threads: two processes with a thread per core each would make four threads spin on two cores.
# So do the processes its tests start (the GPU stages' rehearsals and their pytest steps,
# benchmarks, tensor-parallel ranks), unless a caller set theirs: the tp stage's rehearsal beside a
# busy core spent 108 s of CPU with a thread per core, 88 s with one.
XDIST_PROCESSES = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if XDIST_PROCESSES > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // XDIST_PROCESSES))
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language  # noqa: F401

    import kernels  # noqa: F401

    del os.environ["TRITON_INTERPRET"]


# What collection built (torch's modules and the others, the tests and their items: some 430,000
# objects) lives as long as the process, yet every full garbage collection walks all of it: those
# Python sets off as a run allocates, and the five pytest makes at its end to report unraisable
# exceptions (1.2 s of CPU in all in each process that collected the tree). Frozen, it is left out
# of them (gc.freeze, as worker/__main__.py does with what its start-up built), the garbage of
# collection collected first; unfrozen at exit, or the interpreter would never free it, and
# Triton's C extension (nanobind) would report each of its objects as a leak.
@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
