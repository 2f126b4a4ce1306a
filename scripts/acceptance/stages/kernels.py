"""kernels: every Triton kernel compiled on the GPU and checked against its torch reference, then
compute-sanitizer's memcheck over the paged kernels (decode, extend, KV store)."""

from scripts.acceptance.step import Kind, Stage, Step, pytest_args, tests

PAGED_KERNEL_TESTS = (
    "tests/kernels/test_decode_attention.py",
    "tests/kernels/test_extend_attention.py",
    "tests/kernels/test_kv_store.py",
)

STAGE = Stage(
    "kernels",
    "every Triton kernel compiled on the GPU against its reference; memcheck over the paged kernels",
    (
        tests(
            "smoke",
            "one kernel (RMSNorm) compiled, run and checked: the toolchain and the driver work",
            ("-x", "tests/kernels/test_rms_norm.py"),
            gate=True,
            timeout_s=180,
        ),
        # Eight processes on the GPU: the tests are independent and their time is Triton's compiles, on the CPU.
        tests(
            "tests",
            "every kernel test (GQA ratios, page sizes, ragged lengths; fp32, fp16, bf16)",
            ("-n", "8", "tests/kernels"),
            rehearsal=("tests/kernels/test_kv_store.py", "tests/kernels/test_decode_attention.py", "-k", "fp32"),
            timeout_s=360,
        ),
        # A tensor of its own per allocation (no caching allocator), so memcheck sees each one's bounds.
        Step(
            "memcheck",
            "compute-sanitizer memcheck over the decode, extend and KV-store kernel tests",
            Kind.PYTEST,
            (
                "compute-sanitizer",
                "--tool",
                "memcheck",
                "--error-exitcode",
                "1",
                "--target-processes",
                "all",
                *pytest_args(*PAGED_KERNEL_TESTS),
            ),
            None,
            timeout_s=420,
            tool="compute-sanitizer",
            env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
        ),
    ),
)
