"""engine: the engine and the model on CUDA: decode CUDA graphs and overlapped steps against eager
synchronous ones, greedy parity with transformers in bf16 at the qwen3-0.6b shape, no Triton
compile after warm-up, then the rest of the engine and model tests."""

from scripts.acceptance.step import Stage, tests

# The dense model's; the MoE model's runs in the tests step.
GRAPH_SMOKE = "test_on_cuda_captured_graphs_and_overlap_generate_what_eager_synchronous_steps_do[auto-dense]"

STAGE = Stage(
    "engine",
    "the engine on CUDA: graphs and overlap vs eager, bf16 parity, no compile after warm-up",
    (
        tests(
            "graph-smoke",
            "one engine captures its decode CUDA graphs and, overlapped, generates what eager steps do",
            (f"tests/engine/test_cuda_graph.py::{GRAPH_SMOKE}",),
            gate=True,
            timeout_s=240,
        ),
        tests(
            "parity-bf16",
            "bf16 at the qwen3-0.6b shape (8 prompts): as close to float32 as transformers' bf16, greedy tokens equal "
            "transformers' or parted at a float32 tie",
            ("-s", "tests/model/test_parity_bf16.py"),
            timeout_s=300,
        ),
        tests(
            "no-compiles",
            "no Triton compile after warm-up over a varied batch (graphs and eager)",
            ("tests/engine/test_warm_up.py",),
            rehearsal=("tests/engine/test_warm_up.py", "-k", "varied_batch or on_cuda"),
            timeout_s=240,
        ),
        tests(
            "tests",
            "the engine and model tests (those that need CUDA on the GPU, the rest on the host's CPU)",
            (
                "tests/engine",
                "tests/model",
                "--ignore=tests/model/test_parity_bf16.py",
                "--ignore=tests/engine/test_warm_up.py",
                "--deselect",
                f"tests/engine/test_cuda_graph.py::{GRAPH_SMOKE}",
            ),
            rehearsal=(
                "tests/engine/test_overlap.py",
                "tests/engine/test_memory.py",
                "tests/engine/test_cuda_graph.py",
                "-k",
                "not tight and not roomy",
            ),
            timeout_s=420,
        ),
    ),
)
