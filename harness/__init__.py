"""What the tests and the benchmarks both run: the processes they start (processes.py) and the
redis-servers built on them, one `eventually` (polling.py), the queue loop in this process over the
echo engine (echo_workers.py), the random fault schedules (chaos_schedules.py), the model's
reference runner, shapes and float8 KV accuracy (paged_model.py, model_configs.py, kv_accuracy.py)
and a block's peak memory (peak_memory.py). Neither shipped nor installed: it runs from a checkout,
as tests/ and bench/ do, and imports neither of them (tests/structure/test_layers.py)."""
