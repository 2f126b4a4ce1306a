"""tp: tensor parallelism. Each rank's share of the weights and the step ring first (host-only,
cheap); then what one GPU can check: a worker asking for more ranks than it sees is refused with one
line, and two ranks over gloo on the host's CPU generate what one does. On 2 GPUs: ranks over NCCL
with captured graphs and overlap generate token for token what one rank does, a worker of two ranks
serves through the queue (a killed or hung rank takes it down, its jobs finish elsewhere), and the
costs: the step inputs' ring against a broadcast, the vocabulary-parallel head, the decode step."""

from scripts.acceptance.step import Figure, Stage, script, tests

WORKER_TESTS = "tests/chaos/test_tensor_parallel_worker.py"
REFUSED_ON_ONE_GPU = f"{WORKER_TESTS}::test_a_worker_refuses_more_ranks_than_visible_gpus_with_one_line"
KILLED_RANK = f"{WORKER_TESTS}::test_a_rank_killed_or_hung_takes_the_worker_down_and_its_jobs_finish_elsewhere[kill]"
GRAPHS_ON_TWO_GPUS = (
    "tests/engine/test_tensor_parallel_lifecycle.py::"
    "test_on_two_gpus_captured_graphs_and_overlap_generate_what_one_eager_rank_does"
)

FIGURES = (
    Figure(
        "step inputs of 64 decodes: CPU time, process-group broadcast / shared-memory ring",
        r"^decode, 64 requests .*\|\s+([\d.]+)x$",
    ),
    Figure("LM head at 64 rows: vocabulary split + gather / rank 0 alone", r"^\s+64\s+[\d.]+\s+[\d.]+\s+([\d.]+)x$"),
    Figure("decode step wall: 2 ranks / 1 rank", r"^2 ranks, .*\s([\d.]+)x$"),
)

STAGE = Stage(
    "tp",
    "tensor parallelism: shares, one GPU's checks, parity over 2 GPUs with graphs, the worker, costs",
    (
        tests(
            "shares",
            "each rank's heads, rows and vocabulary, its slices of safetensors (peak RSS), the step ring",
            ("tests/model/test_tensor_parallel_shares.py", "tests/engine/test_step_ring.py"),
            gate=True,
            host_only=True,
            timeout_s=180,
        ),
        # One GPU shown to the step whatever the host has, so a 2-GPU host checks the refusal too.
        tests(
            "one-gpu",
            "2 ranks refused with one line where 1 GPU is visible; 2 gloo ranks on the host's CPU match 1",
            (REFUSED_ON_ONE_GPU, "tests/engine/test_tensor_parallel.py"),
            rehearsal=(REFUSED_ON_ONE_GPU,),
            env={"CUDA_VISIBLE_DEVICES": "0"},
            host_only=True,
            timeout_s=180,
        ),
        tests(
            "parity",
            "2 ranks over NCCL, graphs and overlap on, generate token for token what 1 rank does",
            ("tests/engine/test_tensor_parallel.py", GRAPHS_ON_TWO_GPUS),
            rehearsal=("tests/engine/test_tensor_parallel.py", "-k", "kv-replicated"),
            gpus=2,
            timeout_s=300,
        ),
        tests(
            "worker",
            "a worker of 2 GPU ranks serves through the queue and drains; a killed or hung rank takes it down",
            (WORKER_TESTS,),
            rehearsal=(KILLED_RANK,),
            gpus=2,
            timeout_s=240,
        ),
        script(
            "bench",
            "step inputs (ring vs broadcast), the LM head split vs rank 0 alone, decode step 1 rank vs 2",
            (
                "-m",
                "bench.tp",
                "--parts",
                "broadcast",
                "head",
                "step",
                "--device",
                "cuda",
                "--model",
                "qwen3-0.6b",
                "--batch",
                "64",
                "--messages",
                "500",
            ),
            (
                "-m",
                "bench.tp",
                "--parts",
                "broadcast",
                "head",
                "step",
                "--model",
                "tiny",
                "--messages",
                "50",
                "--hidden-size",
                "64",
                "--steps",
                "3",
                "--batch",
                "4",
            ),
            gpus=2,
            timeout_s=300,
            figures=FIGURES,
        ),
    ),
)
