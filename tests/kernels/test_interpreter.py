"""The interpreter as tests/kernels/conftest.py sets it up for the kernel tests on CPU."""

import importlib

import pytest
import torch
from triton.runtime import interpreter


def test_a_helper_called_inside_a_launch_does_not_scan_the_language_again(device, monkeypatch):
    # The launch's patch of triton.language serves its helpers (conftest's
    # patch_the_language_once_per_launch): scans per launch do not grow with the helper calls.
    if device != "cpu":
        pytest.skip("the interpreter's own patching: kernels run compiled on a GPU")
    calls = importlib.import_module("tests.kernels.interpreted_helper_calls")
    plain_scan = interpreter._patch_builtin
    scans = []

    def scan(*args):
        scans.append(args[0])
        return plain_scan(*args)

    monkeypatch.setattr(interpreter, "_patch_builtin", scan)
    scans_by_calls = {}
    for n in (1, 8):
        x = torch.zeros(4)
        scans.clear()
        calls.add_calls_kernel[(1,)](x, CALLS=n)
        scans_by_calls[n] = len(scans)
        assert torch.equal(x, torch.full((4,), float(n)))  # every helper call ran, interpreted
    assert scans_by_calls[8] == scans_by_calls[1] > 0, scans_by_calls
