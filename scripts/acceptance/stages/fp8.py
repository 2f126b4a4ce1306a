"""fp8: the float8 e4m3 KV cache on the GPU: the KV store, decode and extend kernels compiled over
float8 pages and checked against their torch references, the engine over a float8 pool (twice the
pages, decode graphs, a worker serving jobs), the attention kernels' bandwidth at fp8 against bf16
at Qwen3-8B's heads, then the cache's accuracy against the float32 cache on the parity shapes."""

from scripts.acceptance.step import Figure, Stage, script, tests

FP8_KERNEL_FILES = (
    "tests/kernels/test_kv_store.py",
    "tests/kernels/test_decode_attention.py",
    "tests/kernels/test_extend_attention.py",
    "tests/kernels/test_cpu_decode_attention.py",
)
# test_fp8_kv_cache.py whole (its module name matches), the decode graphs over a float8 pool, a worker serving jobs.
FP8_ENGINE_FILES = (
    "tests/engine/test_fp8_kv_cache.py",
    "tests/engine/test_cuda_graph.py",
    "tests/e2e/test_worker_start.py",
)
DECODE_SHAPES = ("B=64 ctx=2048", "B=8 ctx=32768")  # bench/fp8_attention.py's at Qwen3-8B's heads
ACCURACY_CONFIG = "gqa2-hd128-untied"  # tests/model/test_parity.py's, at Qwen3's head_dim


def decode_figures(shape: str) -> tuple[Figure, ...]:
    """From bench/fp8_attention.py's rows: | kernel | shape | KV cache | bytes | wall ms | CPU ms |
    GB/s (share of the copy's) | float8 speed-up |."""
    row = rf"^\| decode attention \| {shape} [^|]*\| {{cache}} \| [^|]* \| [^|]* \| [^|]* \|"
    return (
        Figure(f"decode {shape}, bf16 pages: GB/s", row.format(cache="bfloat16") + r" ([\d,.]+) \(", cuda_only=True),
        Figure(
            f"decode {shape}, fp8 pages: GB/s", row.format(cache="float8_e4m3fn") + r" ([\d,.]+) \(", cuda_only=True
        ),
        Figure(
            f"decode {shape}: fp8 speed-up over bf16",
            row.format(cache="float8_e4m3fn") + r" [^|]* \| ([\d.]+)x \|$",
            ">= 1.5",
            cuda_only=True,
        ),
    )


STAGE = Stage(
    "fp8",
    "the float8 KV cache: kernels over float8 pages, the engine over them, bandwidth vs bf16, accuracy",
    (
        tests(
            "kernels",
            "KV store, decode and extend attention over float8 pages against their torch references",
            ("-x", *FP8_KERNEL_FILES, "-k", "fp8 or float8"),
            rehearsal=("-x", *FP8_KERNEL_FILES, "-k", "(fp8 or float8) and not bf16"),
            gate=True,
            timeout_s=240,
        ),
        tests(
            "engine",
            "a float8 pool: twice the pages, values within their scales, every engine path, decode graphs, "
            "a worker serving jobs",
            (*FP8_ENGINE_FILES, "-k", "fp8 or float8"),
            # The long generation is most of the step's CPU time; the accuracy step rehearses its path.
            rehearsal=(*FP8_ENGINE_FILES, "-k", "(fp8 or float8) and not long_generation"),
            timeout_s=300,
        ),
        script(
            "bench",
            "decode attention (batch 64 x 2,048 and 8 x 32,768), an extend after 31,744 and the KV store, "
            "fp8 against bf16 pages at Qwen3-8B's heads",
            ("-m", "bench.fp8_attention"),
            ("-m", "bench.fp8_attention", "--shapes", "tiny", "--repeats", "3"),
            timeout_s=180,
            env={"OMP_NUM_THREADS": "1"},
            figures=tuple(f for shape in DECODE_SHAPES for f in decode_figures(shape)),
        ),
        script(
            "accuracy",
            f"logit error, KL and greedy agreement of the float8 cache against the float32 cache over "
            f"1,024 generated tokens, on the GPU's kernels ({ACCURACY_CONFIG})",
            ("-m", "bench.fp8_kv_accuracy", "--device", "cuda", "--configs", ACCURACY_CONFIG),
            (
                "-m",
                "bench.fp8_kv_accuracy",
                "--configs",
                ACCURACY_CONFIG,
                "--prompt-tokens",
                "16",
                "--new-tokens",
                "16",
            ),
            timeout_s=240,
            env={"OMP_NUM_THREADS": "1"},
            figures=(
                Figure(
                    "per-head scales: decode max relative logit error",
                    rf"^\| {ACCURACY_CONFIG} \| per-head \| [^|]* \| ([\d.e+-]+) /",
                ),
                Figure(
                    "per-head scales: KL max (nats)",
                    rf"^\| {ACCURACY_CONFIG} \| per-head \| [^|]* \| [^|]* \| ([\d.e+-]+) /",
                ),
                Figure(
                    "per-head scales: greedy agreement",
                    rf"^\| {ACCURACY_CONFIG} \| per-head \| (?:[^|]* \| ){{3}}\d+/\d+ \(([\d.]+)%\)",
                ),
            ),
        ),
    ),
)
