"""long_context: long requests on the GPU: the YaRN table and the rope kernel reading it past the
original window, a 32,768-token request through the engine against transformers (logits, greedy
tokens, the radix cache, the memory multiple), then one 32K request at the qwen3-0.6b shape with
the model's KV cache and the float8 one, beside transformers."""

from scripts.acceptance.step import Figure, Stage, script, tests

YARN_TESTS = (
    "-x",
    "tests/model/test_rope_scaling.py",
    "tests/kernels/test_rope.py::test_qk_norm_rope_reads_a_yarn_table_past_the_original_window",
)
LONG_CONTEXT_TESTS = ("-s", "tests/engine/test_long_context.py")


def bench_figures(cache: str) -> tuple[Figure, ...]:
    """From bench/long_context.py's row: | run | prefill s | speed-up | decode tok/s | speed-up |
    memory for the request | its KV | multiple |."""
    row = rf"^\| engine, KV cache {cache} \|"
    return (
        Figure(f"prefill speed-up over transformers, KV cache {cache}", rf"{row} [\d.]+ \| ([\d.]+)x \|"),
        Figure(f"decode tok/s after the prompt, KV cache {cache}", rf"{row} [\d.]+ \| [\d.]+x \| ([\d,.]+) \|"),
        Figure(f"memory for the request / its KV, KV cache {cache}", rf"{row} .* \| ([\d.]+)x \|$", "<= 2"),
    )


STAGE = Stage(
    "long_context",
    "32K tokens and YaRN: rope past the window, 32K parity with transformers, a 32K request",
    (
        tests(
            "yarn",
            "the YaRN table bit for bit with transformers' and a scaled model past its window; the rope kernel",
            YARN_TESTS,
            gate=True,
            timeout_s=180,
        ),
        # The rehearsal runs the same tests at 4,608 tokens; the 32K run takes minutes of CPU (CI runs it).
        tests(
            "parity-32k",
            "32,768 tokens (30,720 + 2,048 generated, then whole from the radix cache) vs transformers; "
            "memory within 2x the request's KV",
            LONG_CONTEXT_TESTS,
            rehearsal=(*LONG_CONTEXT_TESTS, "-k", "4k"),
            timeout_s=300,
            figures=(
                Figure(
                    "32K worst per-position relative logit error vs transformers",
                    r"^32,768-token parity: worst per-position relative logit error ([\d.e+-]+)",
                    "<= 1e-4",
                    cuda_only=True,
                ),
                Figure(
                    "32K request's memory / its KV (tiny shape, 4 layers)",
                    r"^32K memory: .*: ([\d.]+)x$",
                    "<= 2",
                    cuda_only=True,
                ),
            ),
        ),
        script(
            "bench",
            "a 32,768-token prompt and 512 tokens at the qwen3-0.6b shape, bf16 and float8 KV caches, "
            "beside transformers",
            ("-m", "bench.long_context"),
            ("-m", "bench.long_context", "--model", "tiny", "--prompt-tokens", "2048", "--max-tokens", "16"),
            timeout_s=360,
            env={"OMP_NUM_THREADS": "1"},
            figures=(*bench_figures("auto"), *bench_figures("fp8_e4m3")),
        ),
    ),
)
