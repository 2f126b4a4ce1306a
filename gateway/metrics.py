"""The gateway's Prometheus metrics, on a registry of its own (GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from producer_client.placement import Placement

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


class GatewayMetrics:
    def __init__(self, placement: Placement):
        self.registry = CollectorRegistry()
        self.registry.register(PlacedJobs(placement))
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

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
