"""The gateway's Prometheus metrics, on a registry of its own (GET /metrics)."""

from __future__ import annotations

import asyncio
import logging

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.batch.budget import InFlightBudget
from producer_client import AsyncClient, MiliError
from producer_client.keys import LANES
from producer_client.placement import Placement
from producer_client.schema import QueueStats
from producer_client.tenant_labels import TenantLabels

log = logging.getLogger("gateway")

# How long a scrape waits for the queues' backlogs: well under Prometheus' default scrape_timeout
# (10 s), so that a Redis that does not answer costs the scrape the queue gauges, not the whole scrape.
BACKLOG_TIMEOUT_S = 2.0
TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class PlacedJobs(Collector):
    """The jobs the gateway's client placed on a worker's own stream or on the shared one, read
    from the client's counts at each scrape."""

    def __init__(self, placement: Placement):
        self.placement = placement

    def collect(self):
        family = CounterMetricFamily(
            "mili_gateway_jobs_placed",
            "jobs enqueued, by where placement sent them: a worker's own stream "
            "(affinity) or the queue's shared stream",
            labels=["placement"],
        )
        for outcome, count in self.placement.placed.items():
            family.add_metric([outcome.value], count)
        yield family


# The label a worker's own stream's jobs are counted under in mili_queue_lane_waiting: placed jobs
# wait there whatever their lane, and a worker's stream holds at most about its slots.
PLACED = "placed"


class QueueBacklogs(Collector):
    """Every queue's jobs over every stream that holds them (producer_client.protocol.backlog), as
    read from Redis just before the scrape (`stats`): what KEDA's scaler reads through Prometheus,
    since the jobs of a queue wait in streams no single redis-streams trigger sees. Every gateway
    exports the same values: aggregate them with max, not sum. `stats` None: Redis was not read
    (away, silent, refusing): mili_gateway_redis_up says 0 and the queue series are absent, as an
    exporter whose backend is down answers (redis_exporter's redis_up, mysqld_exporter's mysql_up),
    neither the last values read nor zeros, which KEDA would take for a backlog gone."""

    def __init__(self):
        self.stats: list[QueueStats] | None = None
        self.tenants = TenantLabels("mili_queue_lane_waiting_jobs", log)  # bounded: producers name tenants

    def collect(self):
        yield GaugeMetricFamily(
            "mili_gateway_redis_up",
            "1 if this scrape read the queues' backlogs from Redis; 0 if Redis did not answer or refused "
            "the read (the mili_queue_* series are then absent)",
            value=0 if self.stats is None else 1,
        )
        yield from self.backlog_families()

    def backlog_families(self):
        families = {
            "depth": GaugeMetricFamily(
                "mili_queue_depth_jobs", "jobs of the queue not yet acknowledged: waiting + pending", labels=["queue"]
            ),
            "pending": GaugeMetricFamily(
                "mili_queue_pending_jobs", "jobs of the queue that workers hold (running)", labels=["queue"]
            ),
            "waiting": GaugeMetricFamily(
                "mili_queue_waiting_jobs", "jobs of the queue no worker has read yet: the backlog", labels=["queue"]
            ),
        }
        lanes = GaugeMetricFamily(
            "mili_queue_lane_waiting_jobs",
            "jobs no worker has read yet, by lane and tenant ('' for none); lane 'placed': on workers' own streams",
            labels=["queue", "lane", "tenant"],
        )
        for stats in self.stats or []:
            for name, family in families.items():
                family.add_metric([stats.queue], getattr(stats, name))
            for (lane, tenant), waiting in lane_backlogs(stats, self.tenants).items():
                lanes.add_metric([stats.queue, lane, tenant], waiting)
        yield from families.values()
        yield lanes


async def read_backlogs(
    client: AsyncClient, routed_queues: frozenset[str] = frozenset(), timeout_s: float = BACKLOG_TIMEOUT_S
) -> list[QueueStats] | None:
    """Every queue's stats (the queue index's, and `routed_queues`), for /metrics; None when Redis
    does not answer within `timeout_s` or refuses: the gateway's own metrics are served still and
    the queue series go missing (QueueBacklogs). A queue no worker serves leaves the index an hour
    after its last heartbeat (and a fresh Redis has none), so the queues the gateway routes to are
    counted whatever the index says: the backlog that scales their workers up from zero (KEDA)."""

    async def read() -> list[QueueStats]:
        queues = sorted(set(await client.inspect.queues()) | routed_queues)
        return [await client.on_queue(queue).queue_stats() for queue in queues]

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except (MiliError, redis.RedisError, TimeoutError) as e:
        log.warning("/metrics: the queues' backlogs could not be read: %s", str(e) or f"no answer in {timeout_s} s")
        return None


def lane_backlogs(stats: QueueStats, tenants: TenantLabels) -> dict[tuple[str, str], int]:
    """The waiting jobs of each (lane, tenant label) of the queue whose stream holds jobs, the
    workers' streams summed as PLACED; each lane and PLACED of no tenant always, at 0 when empty, so
    that a query of one lane (KEDA's) gets a value, never an empty answer."""
    waiting: dict[tuple[str, str], int] = {(lane, ""): 0 for lane in (*LANES, PLACED)}
    for s in stats.streams:
        route = (PLACED, "") if s.worker is not None else (s.lane, tenants.label(s.tenant))
        waiting[route] = waiting.get(route, 0) + s.waiting
    return waiting


class GatewayMetrics:
    def __init__(self, placement: Placement):
        self.registry = CollectorRegistry()
        self.registry.register(PlacedJobs(placement))
        self.backlogs = QueueBacklogs()
        self.registry.register(self.backlogs)
        self.requests = Counter(
            "mili_gateway_requests_total",
            "HTTP requests answered, by endpoint (route) and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.time_to_first_byte = Histogram(
            "mili_gateway_time_to_first_byte_seconds",
            "from a request's arrival to the first byte of its body: the whole answer, or a stream's first chunk",
            ["endpoint"],
            buckets=TTFB_BUCKETS,
            registry=self.registry,
        )
        self.open_streams = Gauge(
            "mili_gateway_open_streams", "server-sent event streams open now", registry=self.registry
        )

    def count_batches(self, budget: InFlightBudget) -> None:
        """The gauges of the Batch API lines this gateway has out, read from `budget` at each scrape."""
        Gauge(
            "mili_gateway_batch_in_flight_bytes",
            "the bytes of the jobs of the Batch API lines this gateway has out and not yet answered, all its "
            "batches together: within batch_gateway_in_flight_bytes",
            registry=self.registry,
        ).set_function(lambda: budget.used)
        Gauge(
            "mili_gateway_batches_waiting",
            "batches driven by this gateway that wait for room in batch_gateway_in_flight_bytes",
            registry=self.registry,
        ).set_function(lambda: len(budget.waiting))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
