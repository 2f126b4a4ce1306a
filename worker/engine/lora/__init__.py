"""LoRA adapters in the engine: which adapters a worker serves, where each one is (on disk, in the
host cache, in a device slot), the thread that loads them, and each step's rows by slot."""
