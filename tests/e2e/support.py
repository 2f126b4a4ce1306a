"""The queue and engine settings of the end-to-end tests' shared workers (conftest.py starts them)."""

E2E_QUEUE = "e2e"
MAX_RUNNING = 2
MAX_MODEL_LEN = 256
# Both workers and the offline reference engine use these engine settings.
ENGINE_FLAGS = ("--max-running", str(MAX_RUNNING), "--max-model-len", str(MAX_MODEL_LEN))
