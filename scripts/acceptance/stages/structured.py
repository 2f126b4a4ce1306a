"""structured: structured outputs on the GPU: the token-bitmask kernel compiled and checked against
its reference, the engine's constrained decoding as it serves (decode CUDA graphs, the overlapped
schedule, mask rows copied behind the model), then what a JSON schema on every request costs
qwen3-0.6b's decode at batch 16 and 64 beside the same requests free."""

from scripts.acceptance.step import Figure, Stage, script, tests


def throughput_ratio(batch: int, target: str | None = None) -> Figure:
    return Figure(
        f"throughput with a schema / without, batch {batch}",
        rf"^batch {batch}: throughput with a schema / without = ([\d.]+)",
        target,
    )


def host_time_added(batch: int, target: str | None = None) -> Figure:
    return Figure(
        f"host time the masks add per step at batch {batch}, ms",
        rf"^batch {batch}: .*host time added = ([\d.]+) ms per step",
        target,
    )


STAGE = Stage(
    "structured",
    "structured outputs: the mask kernel, constrained decoding on the device, its cost at batch 16 and 64",
    (
        tests(
            "kernel",
            "the token-bitmask kernel (Triton) against the torch reference, the vocabulary's words included",
            ("-x", "tests/kernels/test_token_bitmask.py"),
            gate=True,
            timeout_s=120,
        ),
        # On CUDA these engines serve as the worker does; the slow ones (every sampling, overlapped
        # against synchronous, preemption) are the point of running them there.
        tests(
            "engine",
            "every constrained output valid (greedy, sampled, penalties), overlapped = synchronous, "
            "free rows untouched beside constrained ones, resume, preemption, thinking, tool calls",
            ("tests/engine/test_structured.py",),
            rehearsal=("tests/engine/test_structured.py", "-k", "free_requests_beside or max_tokens_before"),
            timeout_s=240,
        ),
        script(
            "bench",
            "decode with a JSON schema on every request against none, same run (qwen3-0.6b, batch 16 and 64)",
            ("-m", "bench.structured", "--model", "qwen3-0.6b", "--device", "cuda", "--threads", "0"),
            ("-m", "bench.structured", "--steps", "4", "--tokens", "12", "--rounds", "1", "--num-pages", "512"),
            timeout_s=300,
            figures=(
                Figure("schema compile, ms", r"^schema compile: ([\d.]+) ms"),
                throughput_ratio(16),
                throughput_ratio(64, ">= 0.9"),
                host_time_added(16),
                host_time_added(64, "<= 0.3"),
            ),
        ),
    ),
)
