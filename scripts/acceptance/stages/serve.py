"""serve: the nano-vllm workload through Redis (the bundle's redis-server) to one worker process on
the GPU, against the offline engine in the same run: throughput share, TTFT and TPOT; and a
priority job's time to first token behind another tenant's full batch."""

from scripts.acceptance.step import TINY_KV_CACHE, Figure, Stage, script

# The nano-vllm workload's rehearsal: the same script at a tiny model and six short requests.
NANOVLLM_REHEARSAL = ("-m", "bench.serve", "--workload", "nanovllm", "--model", "tiny", "--num-requests", "6")
NANOVLLM_REHEARSAL += ("--max-prompt", "48", "--max-output", "12", "--threads", "1", *TINY_KV_CACHE)

STAGE = Stage(
    "serve",
    "the nano-vllm workload through the queue: share of offline, TTFT and TPOT p50/p99; priority's TTFT",
    (
        script(
            "smoke",
            "8 short jobs through Redis to a worker on the GPU (tiny model): the service path works",
            ("-m", "bench.serve", "--model", "tiny", "--num-requests", "8", "--max-prompt", "32", "--max-output", "16"),
            (
                "-m",
                "bench.serve",
                "--model",
                "tiny",
                "--num-requests",
                "4",
                "--max-prompt",
                "16",
                "--max-output",
                "4",
                "--threads",
                "1",
                "--producers",
                "2",
                *TINY_KV_CACHE,
            ),
            gate=True,
            timeout_s=300,
            figures=(Figure("share of offline, %", r"= ([\d.]+)% of offline"),),
        ),
        script(
            "nanovllm",
            "the nano-vllm workload through the queue (qwen3-0.6b, 1 worker, 4 producer processes)",
            ("-m", "bench.serve", "--workload", "nanovllm"),
            NANOVLLM_REHEARSAL,
            timeout_s=480,
            figures=(
                Figure("through the queue, output tok/s", r"^through the queue: ([\d,.]+) output tok/s"),
                Figure("share of offline, %", r"= ([\d.]+)% of offline", ">= 90"),
                Figure("TTFT p50, ms", r"^TTFT: p50 ([\d,.]+) ms"),
                Figure("TTFT p99, ms", r"^TTFT: .*p99 ([\d,.]+) ms"),
                Figure("TPOT p50, ms", r"^TPOT: p50 ([\d,.]+) ms"),
                Figure("TPOT p99, ms", r"^TPOT: .*p99 ([\d,.]+) ms"),
            ),
        ),
        script(
            "nanovllm-streamed",
            "the same with every job streamed and read by stream() (issue 25: publication "
            "coalesced and off the step's path)",
            ("-m", "bench.serve", "--workload", "nanovllm", "--stream"),
            (*NANOVLLM_REHEARSAL, "--stream"),
            timeout_s=480,
            figures=(
                Figure("through the queue streamed, output tok/s", r"^through the queue: ([\d,.]+) output tok/s"),
                Figure("share of offline, streamed, %", r"= ([\d.]+)% of offline", ">= 90"),
                Figure("TTFT p50 streamed, ms", r"^TTFT: p50 ([\d,.]+) ms"),
                Figure("TPOT p99 streamed, ms", r"^TPOT: .*p99 ([\d,.]+) ms"),
            ),
        ),
        script(
            "priority-ttft",
            "a priority job's time to first token with every slot held by another tenant's long jobs, "
            "beside the engine idle (issue 42: the engine preempts a lower lane's job for it)",
            ("-m", "bench.tenants", "--ttft", "--ttft-model", "qwen3-0.6b", "--ttft-running", "256"),
            ("-m", "bench.tenants", "--ttft", "--ttft-probes", "3", "--ttft-rounds", "1", "--ttft-running", "2"),
            timeout_s=300,
            figures=(
                Figure(
                    "priority TTFT p99, engine full / idle",
                    r"^priority TTFT p99, engine full / idle: worst round ([\d.]+)x",
                    "<= 1.5",
                ),
            ),
        ),
    ),
)
