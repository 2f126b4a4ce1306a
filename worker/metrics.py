"""Prometheus metrics in vLLM's vocabulary with a `mili_` prefix, in a registry of this
worker's own (no global state: tests run several workers in one process)."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from producer_client.allow import with_head
from producer_client.hosts import ONE_HOST_LINE, Hosts, names_one_host
from producer_client.schema import JobResult
from producer_client.tenant_labels import TenantLabels
from worker.engine.outputs import EngineStats

# vLLM's buckets, widened at the low end where a CPU-free queue path lives.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
ALLOWED_BY_DEFAULT = Hosts.of([])  # addresses, localhost and *.localhost (allowed_hosts' default)
HOST_NOT_ALLOWED = (
    b"this worker's metrics answer a Host header naming an address, localhost or one of allowed_hosts only "
    b"(MILI_ALLOWED_HOSTS, a JSON list)\n"
)
HOST_MISSING_OR_REPEATED = f"{ONE_HOST_LINE}\n".encode()
HOST_LINES = "mili.host_lines"  # the environ key MetricsHandler counts the request's Host lines under
# A scrape sends its request at once; Prometheus's own scrape_timeout defaults to 10 s.
REQUEST_TIMEOUT_S = 10.0
WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
OUTCOMES = ("done", "failed", "cancelled", "expired", "dead_lettered")
TAKEN_FROM = ("own", "shared", "stolen", "reclaimed")

log = logging.getLogger(__name__)


class WorkerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self._engine_totals: dict[str, float] = {}  # the last EngineStats totals counted (engine_totals)
        self._tenants = TenantLabels("mili_served_tokens", log)  # bounded: producers name tenants
        self._add_load_gauges()
        self._add_latency_histograms()
        self._add_job_counters()
        self._add_engine_counters()

    def _add_load_gauges(self) -> None:
        """What the engine holds now, and the queue's depth."""
        r = self.registry
        self.requests_running = Gauge(
            "mili_num_requests_running", "Jobs in the engine that have produced a token.", registry=r
        )
        self.requests_waiting = Gauge(
            "mili_num_requests_waiting", "Jobs in the engine still waiting for their first token.", registry=r
        )
        self.queue_depth = ReadFromRedis(
            "mili_queue_depth", "Unacknowledged entries in the queue stream (XLEN), as of the last heartbeat.", r
        )
        self.redis_up = Gauge(
            "mili_worker_redis_up",
            "1 if Redis answered this worker's last exchange, 0 if not (mili_queue_depth is then absent).",
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "mili_kv_cache_usage_perc", "Fraction of KV pages in use or promised to admitted jobs (0-1).", registry=r
        )

    def _add_latency_histograms(self) -> None:
        """Each done job's latencies, from its result's timings (job_ended)."""
        r = self.registry
        self.ttft = Histogram(
            "mili_time_to_first_token_seconds", "From enqueue to the first token.", buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "mili_time_per_output_token_seconds",
            "Mean time between output tokens, per job.",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "mili_e2e_request_latency_seconds", "From enqueue to the final result.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "mili_request_queue_time_seconds",
            "From enqueue to a worker starting the job.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def _add_job_counters(self) -> None:
        """Jobs ended by outcome, entries taken by source, tokens generated and served."""
        r = self.registry
        self.prompt_tokens = Counter("mili_prompt_tokens", "Prompt tokens of finished jobs.", registry=r)
        self.generation_tokens = Counter("mili_generation_tokens", "Tokens generated.", registry=r)
        jobs = Counter("mili_jobs", "Jobs this worker ended, by outcome.", ["outcome"], registry=r)
        # Each outcome's counter, exported at 0 from the start so that rates are defined, and
        # looked up once: labels() costs more than the increment.
        self.jobs = {outcome: jobs.labels(outcome) for outcome in OUTCOMES}
        taken = Counter(
            "mili_entries_taken",
            "Queue entries this worker took, by source: its own stream (placed on it), the "
            "shared stream, stolen from another worker's stream, reclaimed from a dead or stalled one.",
            ["source"],
            registry=r,
        )
        self.taken = {source: taken.labels(source) for source in TAKEN_FROM}
        self.served = Counter(
            "mili_served_tokens",
            "Tokens this worker served (the prompt and output of each job it settled), by the lane and "
            "tenant ('' for none) they were charged to: the tenants' shares of docs/architecture.md.",
            ["lane", "tenant"],
            registry=r,
        )

    def _add_engine_counters(self) -> None:
        """The engine's running totals (engine_totals): prefix cache, preemptions, grammars,
        speculative decoding, LoRA adapters."""
        r = self.registry
        self.prefix_cache_queries = Counter(
            "mili_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_cache_hits = Counter(
            "mili_prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r
        )
        self.prefix_cache_hit_rate = Gauge(
            "mili_prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / looked up, since the worker started.",
            registry=r,
        )
        self.preemptions = Counter("mili_num_preemptions", "Requests preempted for lack of KV pages.", registry=r)
        self.grammar_cache_hits = Counter(
            "mili_grammar_cache_hits",
            "Structured outputs: jobs whose grammar was compiled already.",
            registry=r,
        )
        self.grammar_compiles = Counter("mili_grammar_compiles", "Structured outputs: grammars compiled.", registry=r)
        self.grammar_compile_seconds = Counter(
            "mili_grammar_compile_seconds",
            "Structured outputs: time spent compiling grammars, off the step loop.",
            registry=r,
        )
        self.draft_tokens = Counter(
            "mili_speculative_draft_tokens", "Speculative decoding: drafted tokens verified.", registry=r
        )
        self.accepted_draft_tokens = Counter(
            "mili_speculative_accepted_tokens", "Speculative decoding: drafted tokens accepted as output.", registry=r
        )
        self.lora_adapter_reads = Counter(
            "mili_lora_adapter_reads", "LoRA adapters read from disk (on the loader thread).", registry=r
        )
        self.lora_adapter_installs = Counter(
            "mili_lora_adapter_installs", "LoRA adapters installed in a device slot.", registry=r
        )

    def serve(
        self, host: str, port: int, hosts: Hosts = ALLOWED_BY_DEFAULT, request_timeout_s: float = REQUEST_TIMEOUT_S
    ) -> tuple[WSGIServer, int]:
        """Start the HTTP endpoint, in a thread of its own; returns (server, bound port). Port 0
        binds any free port. A request whose Host `hosts` does not allow is answered 400, as the
        gateway answers it (producer_client.hosts: a page rebound by DNS to a loopback port); HEAD
        is answered as GET, without the body (head_as_get). A connection whose request (or whose
        reading of the answer) stalls for `request_timeout_s` is closed (MetricsHandler)."""
        app = head_as_get(host_checked(make_wsgi_app(self.registry), hosts))
        handler = type("TimedMetricsHandler", (MetricsHandler,), {"timeout": request_timeout_s})
        server = make_server(host, port, app, server_class_for(host), handler_class=handler)
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        return server, server.server_port

    def redis_answered(self, answered: bool) -> None:
        """The outcome of an exchange with Redis (the loop's: worker/loop/exchanges.py). One that
        failed leaves the depth unknown until a heartbeat reads it again: the last one read would
        show a stale backlog, which KEDA and alerts take for a live one."""
        self.redis_up.set(1 if answered else 0)
        if not answered:
            self.queue_depth.forget()

    def job_ended(self, result: JobResult) -> None:
        self.jobs_ended([result])

    def jobs_ended(self, results: list[JobResult]) -> None:
        """The jobs a publication round ended: each counter moved once for all of them (an inc is
        four Python calls, two a job), each job's latencies observed on their own."""
        statuses: dict[str, int] = {}
        prompt_tokens = 0
        for result in results:
            statuses[result.status] = statuses.get(result.status, 0) + 1
            if result.status != "done":
                continue
            prompt_tokens += result.usage.prompt_tokens
            t = result.timings
            for histogram, seconds in ((self.e2e, t.e2e_s), (self.queue_time, t.queue_s), (self.ttft, t.ttft_s)):
                if seconds is not None:
                    histogram.observe(max(0.0, seconds))
            n = result.usage.completion_tokens
            if n > 1 and t.first_token_at is not None and t.finished_at is not None:
                self.tpot.observe((t.finished_at - t.first_token_at) / (n - 1))
        for status, n in statuses.items():
            self.jobs[status].inc(n)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)

    def tokens_served(self, served: dict[tuple[str, str], int]) -> None:
        """Add the ledger's tokens served per (lane, tenant) since the last call (Ledger.take_served)."""
        for (lane, tenant), tokens in served.items():
            self.served.labels(lane, self._tenants.label(tenant)).inc(tokens)

    def engine_totals(self, stats: EngineStats) -> None:
        """Counters from the engine's running totals (EngineStats)."""
        counters = {
            "cache_queried_tokens": self.prefix_cache_queries,
            "cache_hit_tokens": self.prefix_cache_hits,
            "preemptions": self.preemptions,
            "grammar_cache_hits": self.grammar_cache_hits,
            "grammar_compiles": self.grammar_compiles,
            "grammar_compile_seconds": self.grammar_compile_seconds,
            "draft_tokens": self.draft_tokens,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "adapter_reads": self.lora_adapter_reads,
            "adapter_installs": self.lora_adapter_installs,
        }
        for name, counter in counters.items():
            total = getattr(stats, name)
            counter.inc(total - self._engine_totals.get(name, 0))
            self._engine_totals[name] = total
        if stats.cache_queried_tokens:
            self.prefix_cache_hit_rate.set(stats.cache_hit_tokens / stats.cache_queried_tokens)


class ReadFromRedis(Collector):
    """A gauge of a value read from Redis, absent until read and again once Redis has failed to
    answer (forget), as an exporter whose backend is down answers (the gateway's queue series:
    gateway/metrics.py QueueBacklogs)."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.value: float | None = None
        registry.register(self)

    def set(self, value: float) -> None:
        self.value = value

    def forget(self) -> None:
        self.value = None

    def collect(self) -> Iterable[GaugeMetricFamily]:
        if self.value is not None:
            yield GaugeMetricFamily(self.name, self.documentation, value=self.value)


def host_checked(app: WSGIApp, hosts: Hosts) -> WSGIApp:
    """`app`, answering 400 to an HTTP/1.1 request without one Host line (names_one_host, as the
    gateway answers it) and to one whose Host `hosts` does not allow (the refused name is not
    repeated: the header is the client's to fill)."""

    def checked(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        version = environ.get("SERVER_PROTOCOL", "").removeprefix("HTTP/")
        if not names_one_host(environ.get(HOST_LINES, 0), version):
            refusal = HOST_MISSING_OR_REPEATED
        elif not hosts.allows(environ.get("HTTP_HOST")):
            refusal = HOST_NOT_ALLOWED
        else:
            return app(environ, start_response)
        start_response("400 Bad Request", [("Content-Type", "text/plain; charset=utf-8")])
        return [refusal]

    return checked


def head_as_get(app: WSGIApp) -> WSGIApp:
    """`app`, answering HEAD as it answers GET, without the body (RFC 9110 9.3.2: probes and uptime
    checkers send HEAD). prometheus_client's app answers HEAD 405, and wsgiref sends whatever body
    an app returns, a HEAD's too. The head says the GET's Content-Length, which wsgiref counts from
    the body (an empty one's would say 0: RFC 9110 8.6 allows the GET's length or none). Another
    method's answer (a POST's 405, an OPTIONS) has its Allow name HEAD beside GET (allow_with_head)."""

    def head_only(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") != "HEAD":
            return app(environ, lambda status, headers, *exc: start_response(status, allow_with_head(headers), *exc))
        head: list[Any] = []
        body = app({**environ, "REQUEST_METHOD": "GET"}, lambda *given: head.extend(given))
        try:
            length = sum(len(chunk) for chunk in body)
        finally:
            if hasattr(body, "close"):
                body.close()
        status, headers, *exc_info = head
        if not any(name.lower() == "content-length" for name, _ in headers):
            headers = [*headers, ("Content-Length", str(length))]
        start_response(status, headers, *exc_info)
        return []

    return head_only


def allow_with_head(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """`headers`, their Allow naming HEAD wherever it names GET (producer_client.allow):
    prometheus_client's app lists OPTIONS,GET (its 405 to a POST, its OPTIONS)."""
    return [(name, with_head(value) if name.lower() == "allow" else value) for name, value in headers]


def server_class_for(host: str) -> type[WSGIServer]:
    """prometheus_client's threading server (a scrape that hangs holds no other), of the address
    family of `host` (an IPv6 address binds IPv6)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})


class MetricsHandler(WSGIRequestHandler):
    """No log line per request: Prometheus scrapes every few seconds (prometheus_client's own
    server is as quiet). The environ counts the request's Host lines (HOST_LINES): wsgiref joins
    several into one HTTP_HOST value, which host_checked could not tell from one."""

    def handle(self) -> None:
        """wsgiref's, its socket timed (StreamRequestHandler's `timeout`, set by serve): wsgiref
        waits for a request line and headers without end, so each client that opened a connection
        and sent nothing held a thread of this worker for ever. A timeout closes the connection
        without the traceback socketserver prints for an error."""
        try:
            super().handle()
        except TimeoutError:
            pass

    def get_environ(self) -> dict[str, Any]:
        environ = super().get_environ()
        environ[HOST_LINES] = len(self.headers.get_all("Host", []))
        return environ

    def log_message(self, format: str, *args: Any) -> None:
        pass
