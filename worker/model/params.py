"""How the model's weights are allocated: uninitialized, for the loader to fill."""

import torch
from torch import nn


def empty_weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # No init: the loader overwrites every weight, and initializing 0.6B parameters on CPU costs seconds.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
