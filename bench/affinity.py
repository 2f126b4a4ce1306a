"""Cache-aware placement against the shared stream, on a synthetic multi-turn chat trace, in one
run: the same trace, sent in each of the forms of bench/chat_forms.py (`messages`, plain prompts,
Qwen3's chat format as text, token ids), through three placements of the `tiny` model
(docs/architecture.md):

  shared   N workers, placement off on both sides: every job on the queue's shared stream (MILI
           before placement);
  placed   N workers, placement on: each job on the worker its prompt's root hashes to, within
           the load bound, stolen by a worker with room after steal_delay_ms;
  ideal    one worker whose cache holds the whole trace: every prefix is where every job runs
           (its hit rate is the ceiling; its wall times are one worker's, not N's).

The trace (make_trace): `--conversations` chats of `--turns` turns, each opening with the system
prompt of one of `--groups` groups (about `--system-words` words, a few hundred tokens: chats of a
group share it; 0: no system prompt), then user turns of about 20 words; each assistant answer is
the model's own (greedy, `--max-tokens` tokens, thinking off in `messages`; 64 tokens or more make
long-answer conversations, whose histories outgrow their roots) and goes into the history of the
next turn. A turn is sent once the previous one has its answer, and `--concurrency` chats run at
once.

Printed per form and placement: the share of turns that ran on the worker of the turn before
(which holds the chat's history), prefill tokens computed / prompt tokens, the prefix cache hit rate
(cached / prompt tokens, from each job's usage), TTFT p50/p99 and queue wait p99 (from each job's
timings, on Redis's clock), throughput (jobs/s, and the workers' CPU seconds per job: on a
shared 2-core machine wall time follows the neighbours' load, CPU time much less), where the
workers took their jobs from (own stream, shared, stolen), and the longest time a worker sat idle
while a job waited somewhere (sampled every 50 ms from the heartbeats and the streams). Then the
ratios the targets are stated in, placed against shared and against ideal.

    python -m bench.affinity [--conversations 200 --turns 5 --groups 8 --workers 4 --concurrency 16]
                             [--forms messages,prompt,template,ids --system-words 250 --max-tokens 8]
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue as queues
import random
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass

import redis
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.chat_forms import FORMS, transcript
from bench.measure import cpu_seconds, pct
from harness.processes import start_worker
from producer_client import Client
from producer_client.keys import GROUP, Keys
from producer_client.schema import JobResult
from worker.embedded_redis import EmbeddedRedis
from worker.model.presets import resolve_model_path
from worker.model.tokenizer import Tokenizer

QUEUE = "affinity"
KEYS = Keys()
WORDS = (
    "queue worker cache prefix token model stream batch page radix shard replica deadline priority answer "
    "question context history system user assistant policy schedule engine kernel memory latency throughput "
    "request result event group consumer entry claim steal reclaim heartbeat redis cluster gateway client"
).split()
SAMPLE_S = 0.05


@dataclass
class Conversation:
    system: str  # "": none
    users: list[str]
    adapter: str | None = None  # the LoRA adapter its turns run with (bench/lora_placement.py)


def make_trace(conversations: int, turns: int, groups: int, system_words: int, seed: int) -> list[Conversation]:
    """Chats whose system prompt is their group's (none with system_words 0), with user turns of
    random words."""
    rng = random.Random(seed)
    systems = [
        f"You are assistant {g} of the benchmark. " + " ".join(rng.choice(WORDS) for _ in range(system_words))
        if system_words
        else ""
        for g in range(groups)
    ]
    return [
        Conversation(
            rng.choice(systems),
            [
                f"Chat {c}, turn {t}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 28)))
                for t in range(turns)
            ],
        )
        for c in range(conversations)
    ]


@dataclass(frozen=True)
class Mode:
    name: str
    workers: int
    placement: bool


@dataclass
class Figures:
    chats: list[list[JobResult]]  # each chat's results, turn by turn
    wall_s: float
    cpu_s: float
    taken: dict[str, float]
    hit_rates: list[float]
    idle_while_waiting_s: float

    @property
    def results(self) -> list[JobResult]:
        return [r for chat in self.chats for r in chat]

    @property
    def same_worker(self) -> float:
        """The share of turns after a chat's first that ran on the worker of the turn before."""
        pairs = [(a.worker, b.worker) for chat in self.chats for a, b in itertools.pairwise(chat)]
        return sum(a == b for a, b in pairs) / len(pairs) if pairs else float("nan")

    @property
    def prompt(self) -> int:
        return sum(r.usage.prompt_tokens for r in self.results)

    @property
    def cached(self) -> int:
        return sum(r.usage.cached_prompt_tokens for r in self.results)

    @property
    def computed_share(self) -> float:
        return (self.prompt - self.cached) / self.prompt

    @property
    def hit_rate(self) -> float:
        return self.cached / self.prompt

    def pct_of(self, seconds: list[float], q: float) -> float:
        return pct(seconds, q) if seconds else float("nan")

    @property
    def ttft(self) -> list[float]:
        return [r.timings.ttft_s for r in self.results if r.timings.ttft_s is not None]

    @property
    def queue_wait(self) -> list[float]:
        return [r.timings.queue_s for r in self.results if r.timings.queue_s is not None]


def main() -> None:
    args = parse_args()
    trace = make_trace(args.conversations, args.turns, args.groups, args.system_words, args.seed)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    systems = f"{args.groups} system prompts of ~{args.system_words} words" if args.system_words else "no system prompt"
    print(
        f"trace: {args.conversations} chats x {args.turns} turns, {systems}, {args.max_tokens} tokens per answer, "
        f"{args.concurrency} chats at once; model tiny, {args.kv_cache_mib} MiB of KV cache per worker, "
        f"steal_delay_ms {args.steal_delay_ms}"
    )
    modes = [Mode("shared", args.workers, False), Mode("placed", args.workers, True), Mode("ideal", 1, False)]
    encode = tiny_encoder() if "ids" in args.forms else None
    for form in args.forms:
        figures = {mode.name: run_mode(mode, trace, form, encode, args) for mode in modes}
        print(f"\nform {form} (load average {os.getloadavg()[0]:.2f}):")
        print_table(figures, args)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


def tiny_encoder():
    """The `tiny` model's tokenizer (Qwen3's), text to ids, for the ids form."""
    backend = Tokenizer.from_dir(resolve_model_path("tiny")).backend
    return lambda text: backend.encode(text, add_special_tokens=False).ids


def forms(value: str) -> list[str]:
    chosen = value.split(",")
    unknown = set(chosen) - set(FORMS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown forms {sorted(unknown)}: choose among {', '.join(FORMS)}")
    return chosen


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--groups", type=int, default=8, help="system prompts shared by the chats")
    p.add_argument(
        "--system-words", type=int, default=250, help="words of each system prompt (a few hundred tokens); 0: none"
    )
    p.add_argument("--max-tokens", type=int, default=8, help="tokens of each answer (64 or more: long answers)")
    p.add_argument("--forms", type=forms, default=list(FORMS), help=f"comma-separated, among {', '.join(FORMS)}")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16, help="chats in flight at once")
    p.add_argument("--kv-cache-mib", type=int, default=512, help="each worker's KV pool: holds the whole trace")
    p.add_argument("--steal-delay-ms", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


# -- one placement ----------------------------------------------------------------------------------


def run_mode(
    mode: Mode,
    trace: list[Conversation],
    form: str,
    encode,
    args,
    extra: tuple[str, ...] = (),
    read_more=None,
) -> Figures:
    """The trace through `mode`'s workers (started with the `extra` flags), sent in `form`;
    `read_more(redis, names)` reads what else a caller wants of the workers before they stop."""
    with EmbeddedRedis() as server:
        names = [f"{mode.name}-{i}" for i in range(mode.workers)]
        workers = [start_tiny_worker(server.url, name, mode.placement, args, *extra) for name in names]
        try:
            with Client(server.url, QUEUE, placement=mode.placement) as client:
                wait_ready(client, names)
                pids = [w.pid for w in workers]
                cpu_before = sum(cpu_seconds(pid) for pid in pids)
                monitor = IdleMonitor(server.url, names)
                monitor.start()
                started = time.perf_counter()
                chats = drive(client, trace, form, encode, args, f"{form} {mode.name}")
                wall_s = time.perf_counter() - started
                monitor.stop()
                cpu_s = sum(cpu_seconds(pid) for pid in pids) - cpu_before
                taken, hit_rates = worker_metrics(client.redis, names)
                if read_more is not None:
                    read_more(client.redis, names)
        finally:
            for w in workers:
                w.terminate()
            for w in workers:
                w.wait(timeout=60)
    return Figures(chats, wall_s, cpu_s, taken, hit_rates, monitor.longest_s)


def start_tiny_worker(url: str, name: str, placement: bool, args, *extra: str) -> subprocess.Popen:
    flags = ["--heartbeat-interval-s", "0.1", "--kv-cache-mib", str(args.kv_cache_mib)]
    flags += ["--steal-delay-ms", str(args.steal_delay_ms), "--placement" if placement else "--no-placement", *extra]
    # One torch thread each: the workers share the machine's cores.
    return start_worker(url, QUEUE, *flags, name=name, model="tiny", env={"OMP_NUM_THREADS": "1"})


def wait_ready(client: Client, names: list[str]) -> None:
    """Every worker heartbeats, and has run a job (its first steps pay torch's warm-up)."""
    deadline = time.monotonic() + 300
    while not all(client.redis.exists(KEYS.worker(n)) for n in names):
        if time.monotonic() > deadline:
            raise RuntimeError("workers did not start")
        time.sleep(0.1)
    ran: set[str] = set()
    while ran != set(names):
        ids = [client.submit(f"warm-up {i} {time.time()}", max_tokens=4) for i in range(2 * len(names))]
        ran |= {r.worker for r in client.results(ids, timeout=120)}
    time.sleep(1)  # the warm-up jobs have left every heartbeat's count


def drive(client: Client, trace: list[Conversation], form: str, encode, args, label: str) -> list[list[JobResult]]:
    """`concurrency` threads, each running whole chats turn after turn; each chat's results."""
    todo: queues.Queue[Conversation] = queues.Queue()
    for conversation in trace:
        todo.put(conversation)
    chats: list[list[JobResult]] = []
    bar = tqdm(total=len(trace) * args.turns, desc=label, unit="job", leave=False)

    def chat_loop() -> None:
        while True:
            try:
                conversation = todo.get_nowait()
            except queues.Empty:
                return
            chat = transcript(form, conversation.system, encode)
            results = []
            for user in conversation.users:
                result = client.generate(
                    **chat.ask(user),
                    adapter=conversation.adapter,
                    max_tokens=args.max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                    timeout=600,
                )
                chat.answer(result)
                results.append(result)
                bar.update()
            chats.append(results)

    threads = [threading.Thread(target=chat_loop) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    return chats


def worker_metrics(admin: redis.Redis, names: list[str]) -> tuple[dict[str, float], list[float]]:
    """Entries taken by source over all workers, and each worker's prefix cache hit rate."""
    taken: dict[str, float] = {}
    hit_rates = []
    for name in names:
        port = int(admin.hget(KEYS.worker(name), "metrics_port"))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "mili_entries_taken_total":
                    taken[s.labels["source"]] = taken.get(s.labels["source"], 0) + s.value
                elif s.name == "mili_prefix_cache_hit_rate":
                    hit_rates.append(s.value)
    return taken, hit_rates


class IdleMonitor:
    """The longest span in which some worker ran nothing while a job waited unread in some stream,
    sampled every SAMPLE_S from the heartbeats (refreshed every 0.1 s) and the streams."""

    def __init__(self, url: str, names: list[str]):
        self.redis = redis.Redis.from_url(url, decode_responses=True)
        self.names = names
        self.streams = [KEYS.queue(QUEUE), *(KEYS.own_queue(QUEUE, n) for n in names)]
        self.longest_s = 0.0
        self.since: float | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self.redis.close()

    def _run(self) -> None:
        while not self.done.wait(SAMPLE_S):
            now = time.monotonic()
            if self._idle_while_waiting():
                self.since = now if self.since is None else self.since
                self.longest_s = max(self.longest_s, now - self.since)
            else:
                self.since = None

    def _idle_while_waiting(self) -> bool:
        pipe = self.redis.pipeline(transaction=False)
        for name in self.names:
            pipe.hget(KEYS.worker(name), "running")
        for stream in self.streams:
            pipe.xlen(stream)
            pipe.xpending(stream, GROUP)
        try:
            replies = pipe.execute(raise_on_error=False)
        except redis.RedisError:
            return False
        running = replies[: len(self.names)]
        waiting = 0
        for length, pending in zip(replies[len(self.names) :: 2], replies[len(self.names) + 1 :: 2]):
            if not isinstance(pending, Exception):
                waiting += length - pending["pending"]
        return waiting > 0 and any(r == "0" for r in running)


# -- the report -----------------------------------------------------------------------------------


def print_table(figures: dict[str, Figures], args) -> None:
    print(
        f"{'placement':<10} {'jobs':>5} {'same worker':>11} {'computed/prompt':>15} {'hit rate':>8} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'wait p99':>9} {'jobs/s':>7} {'CPU s/job':>9} {'idle+waiting':>12}  taken from"
    )
    for name, f in figures.items():
        taken = ", ".join(f"{k} {int(v)}" for k, v in sorted(f.taken.items()) if v)
        print(
            f"{name:<10} {len(f.results):>5} {f.same_worker:>11.3f} {f.computed_share:>15.3f} {f.hit_rate:>8.3f} "
            f"{f.pct_of(f.ttft, 50):>8.3f}s "
            f"{f.pct_of(f.ttft, 99):>8.3f}s {f.pct_of(f.queue_wait, 99):>8.3f}s {len(f.results) / f.wall_s:>7.2f} "
            f"{f.cpu_s / len(f.results):>9.4f} {f.idle_while_waiting_s:>11.2f}s  {taken}"
        )
    shared, placed, ideal = figures["shared"], figures["placed"], figures["ideal"]
    print(
        "\nper-worker hit rates: "
        + "; ".join(f"{n} " + ", ".join(f"{r:.3f}" for r in f.hit_rates) for n, f in figures.items())
    )
    print(f"prompt tokens: shared {shared.prompt}, placed {placed.prompt}, ideal {ideal.prompt}")
    print("\ntargets (placed against its baselines, same run):")
    print(
        f"  same worker                  {placed.same_worker:.3f}   (target 1.000: every turn on the worker of the turn "
        f"before; shared: {shared.same_worker:.3f})"
    )
    print(
        f"  hit rate vs ideal            {placed.hit_rate / ideal.hit_rate:.3f}   (target >= 0.9; shared: "
        f"{shared.hit_rate / ideal.hit_rate:.3f})"
    )
    computed = (placed.prompt - placed.cached) / (shared.prompt - shared.cached)
    print(f"  prefill computed vs shared   {computed:.3f}   (target <= 0.5)")
    wait = placed.pct_of(placed.queue_wait, 99) / shared.pct_of(shared.queue_wait, 99)
    print(f"  queue wait p99 vs shared     {wait:.3f}   (target <= 1.1)")
    print(
        f"  CPU s/job vs shared          {(placed.cpu_s / len(placed.results)) / (shared.cpu_s / len(shared.results)):.3f}"
    )
    print(
        f"  jobs/s vs shared             {(len(placed.results) / placed.wall_s) / (len(shared.results) / shared.wall_s):.3f}"
    )
    print(
        f"  longest idle while waiting   {placed.idle_while_waiting_s:.2f}s  (target <= steal delay "
        f"{args.steal_delay_ms / 1000:.2f}s + a scan, sampled every {SAMPLE_S}s)"
    )


if __name__ == "__main__":
    main()
