"""What the numba-compiled CPU kernels share: their fast-math flags and their thread count."""

import numba
import torch

# Reassociation and contraction are what let the dot products vectorize (and fuse into FMAs).
# No flag assumes finite values: NaN and infinity propagate as IEEE says, so a numerical
# fault upstream still reaches the logits, where the sampler catches it.
FASTMATH = {"reassoc", "contract"}

# numba's OpenMP layer runs its kernels on the OpenMP pool torch already has (the same
# libgomp), so numba's threads and torch's never compete for the cores. Its separate thread pool
# (workqueue) measured no faster at 2 threads than at 1 in the engine: torch's idle OpenMP
# threads spin for a while after each op, on the cores numba's threads needed.
numba.config.THREADING_LAYER = "omp"


def _start_pool_keeping_torch_thread_count() -> None:
    # Starting numba's pool sets OpenMP's default thread count to every core, which torch reads
    # as its own. Started here, at import, so torch's count can be put back before anyone
    # relies on it; torch.set_num_threads calls made later apply as usual.
    threads = torch.get_num_threads()
    try:
        numba.np.ufunc.parallel._launch_threads()
    except ValueError:  # no OpenMP runtime numba can load here: any pool it has, at some speed cost
        numba.config.THREADING_LAYER = "default"
        numba.np.ufunc.parallel._launch_threads()
    torch.set_num_threads(threads)


_start_pool_keeping_torch_thread_count()


def use_torch_thread_count() -> None:
    """torch.set_num_threads governs the numba kernels too (it is thread-local in numba, and cheap)."""
    numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
