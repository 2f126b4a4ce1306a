"""Feature combinations through the whole service (issue 40 item 4): tensor parallelism, the
float8 KV cache, a mixture of experts, cache-aware placement, structured outputs and kill -9 with
resume, every pair of them. A real redis-server, real worker processes, the real client, on
2,048-token checkpoints (a dense one and a mixture of experts, with Qwen3's tokenizer), where
grammars compile on the model's own tokens (worker/model/grammar_vocabulary.py).

Which factor is whose decides the layout. The model and the KV cache's dtype are a worker's, and
they decide its greedy tokens, so a queue's workers share them; placement is a queue's (its
workers advertise it, or none does); the number of ranks is a worker's, and two ranks generate
token for token what one does (tests/engine/test_tensor_parallel.py), so each queue has one
worker of each; a format and a crash are a job's. Each row is one queue of two workers:

    row                  model  KV cache  placement  victim (killed -9)  survivor
    moe-fp8-placed       MoE    fp8_e4m3  on         2 ranks             1 rank
    dense-fp8-shared     dense  fp8_e4m3  off        2 ranks             1 rank
    moe-auto-shared      MoE    auto      off        1 rank              2 ranks
    dense-auto-placed    dense  auto      on         1 rank              2 ranks

and runs eight jobs (JOBS): on the victim, two JSON-schema jobs and two free ones that the kill
cuts short and the survivor resumes, a choice and a short free job that end before it; on the
survivor, a JSON-schema job and a free one that nothing interrupts. The rows are a covering array
of strength 2 of model, KV cache and placement; every row has both rank counts, and on each
worker jobs with and without a format, interrupted (killed on the victim, resumed on the
survivor) and not: test_the_rows_and_jobs_cover_every_pair_of_levels checks it.

Every job ends with the tokens of an uninterrupted run (the engine in this process, one rank, the
row's model and KV cache), each format's output valid, one final result; each feature is seen at
work, not only configured: the heartbeat's device lists two ranks and the start-up line their
pids, which die with the killed worker; its KV pages are those of its rank's share in its dtype
(float8: four times float32's) and the log names float8; placement put each job on a worker's own
stream and the workers counted where they took each entry from; every run after the kill resumed
after the tokens its predecessor recorded."""

from __future__ import annotations

import itertools
import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from harness.polling import eventually
from harness.processes import alive
from producer_client import Client
from producer_client.keys import Keys
from producer_client.placement import Placed, prefix_key, rendezvous_score
from producer_client.schema import JobRequest, SamplingParams
from tests.chaos.test_tensor_parallel_worker import rank_pids
from tests.support.jobs import assert_one_final_result, pending_entries, queue_streams, runs, tokens_published
from tests.support.workers import WorkerProcess, start_workers
from worker.model.presets import qwen3_config, qwen3_moe_config, write_random_checkpoint
from worker.model.qwen_tokenizer import write_qwen3_tokenizer_files

KEYS = Keys()
VOCAB = 2048
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32
# Weights at 0.3: greedy continuations that vary from token to token, so a token resumed wrong shows.
SHAPE = dict(
    vocab_size=VOCAB,
    max_position_embeddings=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    tie_word_embeddings=False,
    initializer_range=0.3,
    bos_token_id=None,
    eos_token_id=None,
)
PAGE_SIZE, KV_CACHE_MIB = 4, 8
ENGINE = dict(max_model_len=256, page_size=PAGE_SIZE)
WORKER_FLAGS = (
    "--device",
    "cpu",
    "--max-model-len",
    "256",
    "--page-size",
    str(PAGE_SIZE),
    "--kv-cache-mib",
    str(KV_CACHE_MIB),
    "--max-running",
    "8",
    # Recovery in seconds; tokens recorded every 50 ms, so the kill lands between checkpoints of
    # jobs still running.
    "--claim-idle-ms",
    "2000",
    "--reclaim-interval-s",
    "0.2",
    "--checkpoint-interval-s",
    "0.05",
)
STEAL_DELAY_MS = 600_000  # far past the test's run: no steals (row_worker)


@dataclass(frozen=True)
class Row:
    name: str
    moe: bool
    kv_cache_dtype: str
    placement: bool
    victim_ranks: int
    survivor_ranks: int


ROWS = [
    Row("moe-fp8-placed", moe=True, kv_cache_dtype="fp8_e4m3", placement=True, victim_ranks=2, survivor_ranks=1),
    Row("dense-fp8-shared", moe=False, kv_cache_dtype="fp8_e4m3", placement=False, victim_ranks=2, survivor_ranks=1),
    Row("moe-auto-shared", moe=True, kv_cache_dtype="auto", placement=False, victim_ranks=1, survivor_ranks=2),
    Row("dense-auto-placed", moe=False, kv_cache_dtype="auto", placement=True, victim_ranks=1, survivor_ranks=2),
]

# Twelve 4-to-8-letter words: about 100 tokens of JSON, so that the kill finds these jobs mid-output.
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "words": {
            "type": "array",
            "minItems": 12,
            "maxItems": 12,
            "items": {"type": "string", "pattern": "^[a-z]{4,8}$"},
        },
        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
    },
    "required": ["id", "words", "qty"],
    "additionalProperties": False,
}
COLOURS = ["red", "green", "blue"]


@dataclass(frozen=True)
class JobKind:
    name: str
    on: str  # the worker it is placed on, or (without placement) runs on first: victim or survivor
    format: str | None  # "json", "choice", or None
    interrupted: bool  # cut short by the kill, resumed by the survivor

    def sampling(self) -> dict:
        if self.format == "json":
            return dict(
                max_tokens=240,
                response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}},
            )
        if self.format == "choice":
            return dict(max_tokens=8, response_format={"type": "choice", "choices": COLOURS})
        return dict(max_tokens=200 if self.interrupted or self.on == "survivor" else 2, ignore_eos=True)

    def assert_valid(self, text: str) -> None:
        if self.format == "json":
            jsonschema.validate(json.loads(text), ORDER)
        elif self.format == "choice":
            assert text in COLOURS, text

    def finish_reason(self) -> str:
        return "length" if self.format is None else "stop"


JOBS = [
    JobKind("json-a", "victim", "json", interrupted=True),
    JobKind("json-b", "victim", "json", interrupted=True),
    JobKind("free-a", "victim", None, interrupted=True),
    JobKind("free-b", "victim", None, interrupted=True),
    JobKind("choice", "victim", "choice", interrupted=False),
    JobKind("free-short", "victim", None, interrupted=False),
    JobKind("json-c", "survivor", "json", interrupted=False),
    JobKind("free-c", "survivor", None, interrupted=False),
]
FACTORS = ("ranks", "model", "kv_cache", "placement", "format", "crash")


def run_levels(row: Row, job: JobKind) -> list[dict[str, object]]:
    """The levels of the factors in each run of `job` in `row`: a run's ranks are its worker's, and
    its crash is what the kill did to it (killed, resumed after it, or none)."""
    common = dict(
        model="moe" if row.moe else "dense",
        kv_cache=row.kv_cache_dtype,
        placement=row.placement,
        format=job.format is not None,
    )
    if job.on == "survivor":
        return [dict(common, ranks=row.survivor_ranks, crash="none")]
    if not job.interrupted:
        return [dict(common, ranks=row.victim_ranks, crash="none")]
    return [
        dict(common, ranks=row.victim_ranks, crash="killed"),
        dict(common, ranks=row.survivor_ranks, crash="resumed"),
    ]


def test_the_rows_and_jobs_cover_every_pair_of_levels():
    all_runs = [levels for row in ROWS for job in JOBS for levels in run_levels(row, job)]
    levels = {f: {r[f] for r in all_runs} for f in FACTORS}
    assert levels == {
        "ranks": {1, 2},
        "model": {"moe", "dense"},
        "kv_cache": {"auto", "fp8_e4m3"},
        "placement": {True, False},
        "format": {True, False},
        "crash": {"none", "killed", "resumed"},
    }
    for a, b in itertools.combinations(FACTORS, 2):
        seen = {(r[a], r[b]) for r in all_runs}
        assert seen == set(itertools.product(levels[a], levels[b])), (a, b)


# -- the rows, through the service --------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[bool, Path]:
    """moe -> the checkpoint: a dense Qwen3 and a Qwen3-MoE of the same attention (so the same KV
    pages), 6 experts, 2 per token."""
    dense = qwen3_config(**SHAPE)
    moe = qwen3_moe_config(moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, **SHAPE)
    made = {}
    for is_moe, config, seed in ((False, dense, 11), (True, moe, 9)):
        path = write_random_checkpoint(tmp_path_factory.mktemp("matrix_ckpt"), config, seed=seed, norm_std=0.1)
        write_qwen3_tokenizer_files(path)
        made[is_moe] = path
    return made


@pytest.fixture(scope="module")
def uninterrupted(checkpoints):
    """uninterrupted(row, prompts): the outputs of one rank in this process, on one thread as the
    workers run, for each of JOBS."""
    from worker.engine import Engine

    engines: dict[tuple[bool, str], Engine] = {}

    def run(row: Row, prompts: dict[str, list[int]]) -> list:
        key = (row.moe, row.kv_cache_dtype)
        if key not in engines:
            engines[key] = Engine.from_pretrained(
                checkpoints[row.moe], device="cpu", kv_cache_dtype=row.kv_cache_dtype, num_pages=2048, **ENGINE
            )
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            params = [SamplingParams(temperature=0, **job.sampling()) for job in JOBS]
            return engines[key].generate([prompts[job.name] for job in JOBS], params)
        finally:
            torch.set_num_threads(threads)

    return run


def row_worker(redis_url: str, row: Row, role: str, checkpoint: Path, log_dir: Path) -> WorkerProcess:
    ranks = row.victim_ranks if role == "victim" else row.survivor_ranks
    return WorkerProcess(
        redis_url,
        f"matrix-{row.name}",
        f"matrix-{row.name}-{role}",
        log_dir,
        *WORKER_FLAGS,
        "--tensor-parallel-size",
        str(ranks),
        "--kv-cache-dtype",
        row.kv_cache_dtype,
        "--placement" if row.placement else "--no-placement",
        model=str(checkpoint),
        # Each job runs where it is placed: a survivor of two ranks on a loaded machine can leave a
        # placed entry unread past the default second, and a steal by the victim would move it
        # (stealing has its own tests in tests/queue/test_placement.py).
        env={"MILI_STEAL_DELAY_MS": str(STEAL_DELAY_MS)},
    )


def choose_prompts(row: Row, victim: str, survivor: str) -> dict[str, list[int]]:
    """A prompt of token ids for each job; with placement, one that a producer places on the job's
    worker (its first choice in rendezvous order: the names are fixed, so the choice is too)."""
    workers = {"victim": victim, "survivor": survivor}
    wanted = {role: [job.name for job in JOBS if job.on == role] for role in workers}
    prompts: dict[str, list[int]] = {}
    for i in itertools.count():
        ids = [(37 * i + 11 * j) % (VOCAB - 40) + 20 for j in range(4 + i % 6)]
        if row.placement:
            key = prefix_key(JobRequest.model_validate({"input_ids": ids}))
            role = max(workers, key=lambda r: rendezvous_score(key, workers[r]))
        else:
            role = "victim" if wanted["victim"] else "survivor"
        if wanted[role]:
            prompts[wanted[role].pop(0)] = ids
        if not any(wanted.values()):
            return prompts


def taken(worker: WorkerProcess) -> dict[str, float]:
    """The worker's mili_entries_taken_total by source: own, shared, stolen, reclaimed."""
    port = int(worker.heartbeat()["metrics_port"])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "mili_entries_taken")
    return {s.labels["source"]: s.value for s in family.samples if s.name == "mili_entries_taken_total"}


def expected_pages(row: Row, ranks: int) -> int:
    """kv_cache_mib over a page of this rank's KV heads in the cache's dtype (float32 weights)."""
    element_bytes = 1 if row.kv_cache_dtype == "fp8_e4m3" else 4
    page_bytes = PAGE_SIZE * 2 * LAYERS * (KV_HEADS // ranks) * HEAD_DIM * element_bytes
    return KV_CACHE_MIB * 2**20 // page_bytes


def assert_features_at_work(worker: WorkerProcess, row: Row, ranks: int, checkpoint: Path) -> None:
    """What the worker says of itself while it serves: its ranks, model, placement, and KV pool."""
    beat = worker.heartbeat()
    assert (beat["device"], beat["model"], beat["placement"]) == (
        ",".join(["cpu"] * ranks),
        str(checkpoint),
        "1" if row.placement else "0",
    )
    assert int(beat["total_pages"]) == expected_pages(row, ranks)
    log = worker.log()
    assert ("KV cache in torch.float8_e4m3fn" in log) == (row.kv_cache_dtype == "fp8_e4m3"), log
    assert ("in experts" in log) == row.moe, log  # the loader's line counts a mixture's experts
    if ranks == 2:
        assert len(rank_pids(worker)) == 1


def submit(client: Client, prompts: dict[str, list[int]], role: str) -> dict[str, str]:
    return {
        job.name: client.submit(input_ids=prompts[job.name], temperature=0, **job.sampling())
        for job in JOBS
        if job.on == role
    }


def at_the_kill_point(redis_client, ids: dict[str, str], queue: str, victim: str) -> bool:
    """The victim's short jobs are done, their entries acknowledged (it acknowledges an entry just
    after writing its result), and each of its others runs there with tokens recorded."""
    held = [e for stream in queue_streams(redis_client, queue) for e in pending_entries(redis_client, stream)]
    if sum(e["consumer"] == victim for e in held) != sum(job.on == "victim" and job.interrupted for job in JOBS):
        return False
    for job in JOBS:
        if job.on != "victim":
            continue
        worker, status, tokens = redis_client.hmget(KEYS.job(ids[job.name]), "worker", "status", "tokens")
        assert status != "failed", (job.name, victim)
        if job.interrupted and not (worker == victim and status == "running" and int(tokens or 0) >= 4):
            return False
        if not job.interrupted and status != "done":
            return False
    return True


def kill(victim: WorkerProcess, ranks: int) -> None:
    """kill -9 the worker's process (rank 0): the other ranks die with it."""
    others = rank_pids(victim) if ranks == 2 else []
    victim.process.kill()
    victim.process.wait()
    assert eventually(lambda: not any(alive(pid) for pid in others), timeout=10)


def assert_runs(redis_client, job: JobKind, job_id: str, victim: str, survivor: str) -> int:
    """Who ran the job, and after how many recorded tokens each run began; returns how many the
    survivor resumed after."""
    job_runs = runs(redis_client, job_id)
    starts = [(start["worker"], start["resumed_tokens"]) for start, _ in job_runs]
    if not job.interrupted:
        assert starts == [(victim if job.on == "victim" else survivor, 0)], job.name
        return 0
    (_, made), _ = job_runs
    assert made and starts == [(victim, 0), (survivor, len(made))], (job.name, starts)
    return len(made)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_each_job_of_a_row_ends_as_an_uninterrupted_run_with_every_feature_at_work(
    row, redis_server, redis_client, checkpoints, uninterrupted, tmp_path
):
    checkpoint = checkpoints[row.moe]
    victim, survivor = (
        row_worker(redis_server.url, row, role, checkpoint, tmp_path) for role in ("victim", "survivor")
    )
    prompts = choose_prompts(row, victim.name, survivor.name)
    # Placement needs both workers serving when the jobs are placed; without it, the victim alone
    # takes its jobs from the shared stream, and the survivor starts after the kill.
    first = [victim, survivor] if row.placement else [victim]
    want = uninterrupted(row, prompts)
    try:
        start_workers(first)
        assert_features_at_work(victim, row, row.victim_ranks, checkpoint)
        with Client(redis_server.url, victim.queue) as client:
            ids = submit(client, prompts, "victim") | (submit(client, prompts, "survivor") if row.placement else {})
            assert eventually(lambda: at_the_kill_point(redis_client, ids, victim.queue, victim.name), timeout=180), (
                victim.log()
            )
            victim_taken = taken(victim)
            kill(victim, row.victim_ranks)
            if not row.placement:
                ids |= submit(client, prompts, "survivor")
                start_workers([survivor])
            results = {name: client.result(job_id, timeout=300) for name, job_id in ids.items()}
            placed = dict(client.placement.placed)
        assert_features_at_work(survivor, row, row.survivor_ranks, checkpoint)
        resumed = {}
        for job, expected in zip(JOBS, want):
            result = results[job.name]
            assert (result.status, result.finish_reason) == ("done", job.finish_reason()), (job.name, result.error)
            assert result.token_ids == expected.token_ids, job.name
            job.assert_valid(result.text)
            assert tokens_published(redis_client, ids[job.name]) == result.token_ids  # each token once
            assert_one_final_result(redis_client, ids[job.name])
            resumed[job.name] = assert_runs(redis_client, job, ids[job.name], victim.name, survivor.name)
        print(f"\n{row.name}: resumed after recorded tokens (of the output's): ", end="")
        print(", ".join(f"{n} {k} ({len(results[n].token_ids)})" for n, k in resumed.items() if k))
        # Where each entry went, and where each worker took it from.
        source = "own" if row.placement else "shared"
        assert placed == {Placed.AFFINITY: 8 * row.placement, Placed.SHARED: 8 * (not row.placement)}
        assert victim_taken == {"own": 0, "shared": 0, "stolen": 0, "reclaimed": 0, source: 6}
        assert eventually(lambda: taken(survivor) == {"own": 0, "shared": 0, "stolen": 0, source: 2, "reclaimed": 4})
    finally:
        victim.stop()
        survivor.stop()
