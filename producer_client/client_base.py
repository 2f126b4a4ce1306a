"""What Client and AsyncClient share beside their operations (producer_client.operations and
bulk, written once as steps): their settings, checked before anything connects; a client of
another queue over the same connection pool; the operator's views. Each names how it connects
and how it runs steps."""

from __future__ import annotations

import copy
from typing import Literal, TypeVar

from producer_client.cluster import AsyncRedis, SyncRedis
from producer_client.connection import RedisURL, parse_url
from producer_client.dead_letters import DeadLetters
from producer_client.inspection import QueueInspector
from producer_client.keys import DEFAULT_PREFIX, NO_TENANT, Keys, check_name, check_tenant
from producer_client.new_job import KnownParams
from producer_client.placement import Placement
from producer_client.protocol.replication import Replication
from producer_client.protocol.shards import QueueShards
from producer_client.quotas import Quotas, TenantQuotas
from producer_client.steps import Runner
from producer_client.validation import check_max_connections, check_max_queue_depth, check_placement
from producer_client.waiting import Submissions

DEFAULT_URL = "redis://localhost:6379/0"
DEFAULT_MAX_QUEUE_DEPTH = 10_000

C = TypeVar("C", bound="ClientBase")


class ClientBase:
    redis: SyncRedis | AsyncRedis  # each client's own kind
    run_steps: Runner  # producer_client.steps.run, or .arun for asyncio: runs steps over `redis`

    def __init__(
        self,
        url: str = DEFAULT_URL,
        queue: str = "default",
        *,
        prefix: str = DEFAULT_PREFIX,
        max_queue_depth: int | None = DEFAULT_MAX_QUEUE_DEPTH,
        max_connections: int | None = None,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        placement: bool = True,
        tenant: str | None = None,
        queue_shards: int | Literal["auto"] = 1,
    ):
        self.queue = check_name("queue", queue)
        self.tenant = None if tenant is None else check_tenant("tenant", tenant)
        self.quota_cache = Quotas()
        self.keys = Keys(prefix)
        self.max_queue_depth = check_max_queue_depth(max_queue_depth)
        self.replication = Replication(wait_replicas, wait_timeout_ms)
        self.placement = Placement(check_placement(placement))
        self.shards = QueueShards(queue_shards)
        self.submissions = Submissions()  # shared by its copies (on_queue, as_tenant): ids are unique
        self.known_params: KnownParams = {}  # its jobs' SamplingParams, validated once each (new_job.sampling_params)
        target = parse_url(url)
        self.replication.check_within(target.options.get("socket_timeout"))
        self.redis = self._connect(target, check_max_connections(max_connections))

    def _connect(self, target: RedisURL, max_connections: int | None) -> SyncRedis | AsyncRedis:
        """A redis-py client of `target`, with the clients' retry policy."""
        raise NotImplementedError

    @property
    def tenant_name(self) -> str:
        """The tenant as keys name it: NO_TENANT for none."""
        return NO_TENANT if self.tenant is None else self.tenant

    def on_queue(self: C, queue: str) -> C:
        """A client of `queue` with this one's settings, over the same connection pool: one pool
        serves every queue (closing either client closes it)."""
        other = copy.copy(self)
        other.queue = check_name("queue", queue)
        return other

    def as_tenant(self: C, tenant: str | None) -> C:
        """A client submitting as `tenant` (None: no tenant) with this one's settings, over the same
        connection pool and the same copies of the tenants' quotas: how a gateway serves each API
        key's requests."""
        other = copy.copy(self)
        other.tenant = None if tenant is None else check_tenant("tenant", tenant)
        return other

    @property
    def dead_letters(self) -> DeadLetters:
        """The queue's dead letters: list, get, retry, purge (producer_client.dead_letters)."""
        return DeadLetters(self.redis, self.keys, self.queue, self.run_steps)

    @property
    def tenant_quotas(self) -> TenantQuotas:
        """Every tenant's quotas and rate limits: get, set, all (producer_client.quotas)."""
        return TenantQuotas(self.redis, self.keys, self.run_steps)

    @property
    def inspect(self) -> QueueInspector:
        """What the queue holds now: waiting and running jobs, depth, workers (producer_client.inspection)."""
        return QueueInspector(self.redis, self.keys, self.queue, self.run_steps)
