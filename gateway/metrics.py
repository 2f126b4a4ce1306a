"""The gateway's Prometheus metrics, on a registry of its own (GET /metrics)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mili_gateway_requests_total", "HTTP requests answered, by endpoint (route) and status code",
            ["endpoint", "status"], registry=self.registry,
        )
        self.time_to_first_byte = Histogram(
            "mili_gateway_time_to_first_byte_seconds",
            "from a request's arrival to the first byte of its body: the whole answer, or a stream's first chunk",
            ["endpoint"], buckets=TTFB_BUCKETS, registry=self.registry,
        )
        self.open_streams = Gauge("mili_gateway_open_streams", "server-sent event streams open now", registry=self.registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
