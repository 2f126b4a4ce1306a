"""The one rule for choosing Triton or the torch reference."""

import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    # Read at call time: tests flip TRITON_INTERPRET per process, and the
    # interpreter runs kernels on CPU tensors, which is how CI checks them.
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
