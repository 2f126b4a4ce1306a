"""moe: Qwen3-MoE on the GPU: the fused expert kernels compiled and checked against the per-expert
loop, the MoE engine (graphs capture its layers, no host wait, the memory plan counts the experts),
then the kernels' bandwidth at Qwen3-30B-A3B's shapes and its decode step against the bound."""

from scripts.acceptance.step import Figure, Stage, script, tests

MOE_ENGINE_TESTS = (
    "tests/engine/test_moe_engine.py",
    "tests/engine/test_cuda_graph.py",
    "tests/engine/test_warm_up.py",
    "tests/model/test_parity.py",
    "tests/model/test_moe_checkpoint.py",
    "-k",
    "moe",
)


def decode_ratio(batch: int) -> Figure:
    return Figure(
        f"Qwen3-30B-A3B decode step / bound at batch {batch}",
        rf"^\| Qwen3-30B-A3B.* \| batch {batch}, .*? \| ([\d.]+)x \|",
        "<= 2",
        cuda_only=True,
    )


def kernel_share(tokens: int) -> Figure:
    return Figure(
        f"fused MoE at {tokens} tokens, share of HBM",
        rf"^\| E=128 k=8 H=2048 I=768 T={tokens} .*= (\d+)% of HBM",
        cuda_only=True,
    )


STAGE = Stage(
    "moe",
    "Qwen3-MoE: fused expert kernels, the MoE engine, kernel bandwidth and decode step at 30B-A3B",
    (
        tests(
            "kernels",
            "the expert alignment and the grouped gate/up and down GEMMs against the per-expert loop",
            ("-x", "tests/kernels/test_fused_moe.py"),
            rehearsal=("-x", "tests/kernels/test_fused_moe.py", "-k", "fp32 and (every_block_size or no_tokens)"),
            gate=True,
            timeout_s=240,
        ),
        tests(
            "engine",
            "MoE parity with transformers, graphs capturing the MoE layers, no host wait, the memory plan",
            MOE_ENGINE_TESTS,
            rehearsal=("tests/engine/test_moe_engine.py", "-k", "memory_plan or on_cuda"),
            timeout_s=360,
        ),
        # 24 of the 48 layers: the step/bound ratio does not depend on the depth, and half the weights
        # (28 GiB instead of 57) leave the KV pool and the graphs room on an 80 GB card.
        script(
            "bench",
            "the fused kernel at 30B-A3B's shapes (HBM share, TFLOP/s) and decode steps at batch 64 and 256",
            ("-m", "bench.moe", "--layers", "24"),
            ("-m", "bench.moe", "--tiny", "--steps", "3"),
            timeout_s=360,
            env={"OMP_NUM_THREADS": "1"},
            figures=(kernel_share(64), kernel_share(256), decode_ratio(64), decode_ratio(256)),
        ),
    ),
)
