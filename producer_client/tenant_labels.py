"""The `tenant` label of MILI's metrics (a worker's mili_served_tokens, the gateway's
mili_queue_lane_waiting_jobs): tenants are names producers choose, without bound, and each distinct
one is a series per lane, held by the process and by Prometheus for ever. So past MAX_TENANT_LABELS
tenants the rest count under OTHER_TENANTS, as exporters bound a label of client-given values.
Imported by those programs only: the one layer both import."""

from __future__ import annotations

import logging

from producer_client.keys import NO_TENANT

MAX_TENANT_LABELS = 100
# Not a tenant's name: TENANT_PATTERN starts with one of [A-Za-z0-9].
OTHER_TENANTS = "_other"


class TenantLabels:
    """The `tenant` label values of one metric: '' for no tenant, its name for the first
    MAX_TENANT_LABELS tenants this process labelled, OTHER_TENANTS for any other (said once, in
    `log`)."""

    def __init__(self, metric: str, log: logging.Logger):
        self.metric, self.log = metric, log
        self.named: set[str] = set()  # the tenants with series of their own
        self.past_cap = False  # whether a tenant has counted under OTHER_TENANTS yet

    def label(self, tenant: str | None) -> str:
        """The label of `tenant` (None or NO_TENANT: no tenant)."""
        if tenant is None or tenant == NO_TENANT:
            return ""
        if tenant in self.named:
            return tenant
        if len(self.named) < MAX_TENANT_LABELS:
            self.named.add(tenant)
            return tenant
        if not self.past_cap:
            self.past_cap = True
            self.log.warning(
                "metrics: more than %d tenants in %s; those past them count under tenant=%r",
                MAX_TENANT_LABELS,
                self.metric,
                OTHER_TENANTS,
            )
        return OTHER_TENANTS
