"""bench: the figures of the GPU acceptance (issue 34's targets) at the qwen3-0.6b shape: the kernels
against the measured HBM bandwidth, a decode step against its weights+KV bound, a profile of steady
decode steps, the nano-vllm workload offline beside transformers, and its ablations."""

from scripts.acceptance.step import TINY_KV_CACHE, Figure, Stage, script

TOKENS_PER_S = r"= ([\d,.]+) output tok/s"
TINY_WORKLOAD = (
    "--model",
    "tiny",
    "--workload",
    "nanovllm",
    "--num-requests",
    "4",
    "--max-prompt",
    "32",
    "--max-output",
    "8",
    *TINY_KV_CACHE,
)


def decode_share(batch: int) -> Figure:
    # bench.triton_kernels' tiny shape, which a rehearsal runs, decodes at batch 16 only.
    return Figure(
        f"decode attention at batch {batch}, share of the copy's bandwidth",
        rf"^\| paged_decode_attention \| B={batch} .*?torch reference.*?= (\d+)% of the copy's",
        ">= 60",
        cuda_only=batch != 16,
    )


STAGE = Stage(
    "bench",
    "the figures: kernels, decode step vs its bound and its profile, offline vs transformers, ablations",
    (
        script(
            "kernels",
            "each kernel at the qwen3-0.6b shapes; GB/s as a share of a copy's, measured in the same run",
            ("-m", "bench.triton_kernels", "--shape", "qwen3-0.6b"),
            ("-m", "bench.triton_kernels", "--shape", "tiny", "--dtype", "fp32"),
            gate=True,
            timeout_s=180,
            figures=(
                Figure("copy bandwidth, GB/s", r"measured copy bandwidth: ([\d,]+) GB/s"),
                *(decode_share(batch) for batch in (16, 64, 256)),
            ),
        ),
        script(
            "decode-step",
            "a decode step at batch 256, context 1024, against the weights+KV bound; then a "
            "torch.profiler trace of 20 steady decode steps: GPU-busy share, gaps",
            ("-m", "bench.decode_step", "--trace", "{out}/decode_trace.json.gz"),
            (
                "-m",
                "bench.decode_step",
                "--model",
                "tiny",
                "--batch",
                "8",
                "--context",
                "64",
                "--steps",
                "3",
                "--profile-steps",
                "5",
                "--trace",
                "{out}/decode_trace.json.gz",
                *TINY_KV_CACHE,
            ),
            gate=True,
            timeout_s=300,
            figures=(
                Figure("model step / bound", r"^model step: .*= ([\d.]+)x the bound", "<= 2"),
                Figure("engine step / bound", r"^engine step: .*= ([\d.]+)x the bound", "<= 2"),
                Figure("profiled step median, ms", r"^profiled \d+ engine steps .*: median ([\d.]+) ms"),
                Figure("GPU busy share, %", r"^GPU busy: ([\d.]+)% of the profiled steps' span", cuda_only=True),
                Figure("GPU idle gap max, us", r"^GPU idle gaps: .*max ([\d.]+) us", cuda_only=True),
            ),
        ),
        script(
            "offline",
            "the nano-vllm workload offline (256 requests, in/out in [100, 1024]) beside transformers",
            ("-m", "bench.offline", "--workload", "nanovllm", "--hf-batch-size", "128"),
            ("-m", "bench.offline", *TINY_WORKLOAD, "--hf-batch-size", "4"),
            timeout_s=420,
            figures=(
                Figure("engine, output tok/s", rf"^engine: .*{TOKENS_PER_S}", ">= 20000"),
                Figure("transformers, output tok/s", rf"^transformers: .*{TOKENS_PER_S}"),
                Figure("engine / transformers", r"^ratio: +([\d.]+)x"),
            ),
        ),
        script(
            "no-graphs",
            "the same workload without decode CUDA graphs (an ablation)",
            ("-m", "bench.offline", "--workload", "nanovllm", "--skip-hf", "--no-cuda-graphs"),
            ("-m", "bench.offline", *TINY_WORKLOAD, "--skip-hf", "--no-cuda-graphs"),
            timeout_s=300,
            figures=(Figure("engine without graphs, output tok/s", rf"^engine: .*{TOKENS_PER_S}"),),
        ),
        script(
            "no-overlap",
            "the same workload without overlapped scheduling (an ablation)",
            ("-m", "bench.offline", "--workload", "nanovllm", "--skip-hf", "--no-overlap-schedule"),
            ("-m", "bench.offline", *TINY_WORKLOAD, "--skip-hf", "--no-overlap-schedule"),
            timeout_s=300,
            figures=(Figure("engine without overlap, output tok/s", rf"^engine: .*{TOKENS_PER_S}"),),
        ),
    ),
)
