"""speculative: lossless speculative decoding on the GPU. Verify steps through the extend kernel and
their CUDA graphs with overlap, in float32 and float8 pools and with LoRA adapters' rows, generate
what eager plain steps do; then tokens/s with and without speculation at batch 1, 16, 64 and 256 on the qwen3-0.6b
shape, with a draft model (`tiny`) and with a random EAGLE-3 head in the published layout, each
proposer run for its cost and its tokens set right with probability p (acceptance length 3 by
construction), the engine's adaptive rule deciding each step."""

from scripts.acceptance.step import Figure, Stage, script, tests

BATCHES = (1, 16, 64, 256)
METHODS = ("draft", "eagle3")
TARGETS = {1: ">= 2.2", 256: ">= 0.98"}  # batch 1 at acceptance length 3; batch 256 loses at most 2%


def speedup(method: str, batch: int) -> Figure:
    return Figure(
        f"{method}, batch {batch}: tokens/s with speculation / without",
        rf"^stage {method} batch {batch}: .*: ([\d.]+)x ",
        TARGETS.get(batch),
        cuda_only=batch not in (1,),
    )


STAGE = Stage(
    "speculative",
    "speculative decoding: verify graphs with overlap equal plain steps; tokens/s at batch 1-256, draft and EAGLE-3",
    (
        tests(
            "equality",
            "outputs with speculation (graphs, overlap, float8, adapters) equal the engine's without, token for token",
            (
                "tests/engine/test_speculative_graphs.py",
                "tests/engine/test_speculative_lora.py",
                "tests/engine/test_speculative_sampling.py",
            ),
            gate=True,
            timeout_s=300,
        ),
        script(
            "bench",
            "tokens/s with and without speculation at acceptance length 3 by construction, draft and EAGLE-3",
            (
                "-m",
                "bench.speculative",
                "--parts",
                "stage",
                "--model",
                "qwen3-0.6b",
                "--device",
                "cuda",
                "--stage-batches",
                *map(str, BATCHES),
                "--prompt",
                "256",
                "--output",
                "128",
            ),
            (
                "-m",
                "bench.speculative",
                "--parts",
                "stage",
                "--model",
                "tiny",
                "--stage-batches",
                "1",
                "--prompt",
                "8",
                "--output",
                "12",
                "--repeats",
                "1",
            ),
            timeout_s=420,
            figures=tuple(speedup(m, b) for m in METHODS for b in BATCHES),
        ),
    ),
)
