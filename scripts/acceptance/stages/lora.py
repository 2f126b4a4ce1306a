"""lora: LoRA adapters on the GPU: the shrink and expand kernels compiled and checked against their
references (no host wait), adapters through the engine as it serves (decode graphs replaying adapter
rows, token for token with the CPU engine), then a decode step of batch 64 spread over 8 adapters of
rank 16 beside the base model alone at the qwen3-0.6b shape (issue 46's target: <= 1.2x)."""

from scripts.acceptance.step import Figure, Stage, script, tests

STAGE = Stage(
    "lora",
    "LoRA adapters: the batched shrink/expand kernels, adapters in decode graphs, decode step beside the base",
    (
        tests(
            "kernels",
            "shrink and expand against their references over mixed adapters and ranks 8-128, no host wait",
            ("-x", "tests/kernels/test_lora.py"),
            gate=True,
            timeout_s=180,
        ),
        tests(
            "engine",
            "adapter rows in the decode graphs token for token with the CPU engine, graphs padded, warm-up",
            (
                "tests/engine/test_lora_engine.py",
                "tests/engine/test_warm_up.py",
                "-k",
                "on_cuda or graph or lora_warm_up",
            ),
            rehearsal=("tests/engine/test_lora_engine.py", "-k", "graph or mixing"),
            timeout_s=360,
        ),
        script(
            "bench",
            "decode step at batch 64 with 8 adapters of rank 16 over the batch, beside the base alone (qwen3-0.6b)",
            ("-m", "bench.lora", "step", "--model", "qwen3-0.6b", "--device", "cuda", "--max-ratio", "1.2"),
            ("-m", "bench.lora", "step", "--model", "tiny", "--batch", "8", "--context", "16", "--steps", "3"),
            timeout_s=360,
            figures=(
                Figure("decode step with adapters / base alone, batch 64", r"= ([\d.]+)x the base$", "<= 1.2"),
                Figure("adapter read from disk, ms", r"^adapter load: read from disk ([\d.]+) ms"),
                Figure("adapter install in a slot, ms", r"installed in a slot ([\d.]+) ms"),
            ),
        ),
    ),
)
