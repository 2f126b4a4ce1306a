"""What the engine's tests share with their fixtures (conftest.py)."""

VOCAB = 2048  # the random checkpoint's vocabulary size (conftest.py)
