"""What the numba-compiled CPU kernels share: their fast-math flags and their thread count."""
import numba
import torch

# Reassociation and contraction are what let the dot products vectorize (and fuse into FMAs).
# No flag assumes finite values: NaN and infinity propagate as IEEE says, so a numerical
# fault upstream still reaches the logits, where the sampler catches it.
FASTMATH = {"reassoc", "contract"}

# numba's OpenMP layer would share torch's libgomp and reset its thread count (torch then reports
# and may use numba's count); its plain thread pool leaves torch's settings alone. It must not
# launch kernels from two threads at once, and the engine steps from one thread.
numba.config.THREADING_LAYER = "workqueue"


def use_torch_thread_count() -> None:
    """torch.set_num_threads governs the numba kernels too (it is thread-local in numba, and cheap)."""
    numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))

