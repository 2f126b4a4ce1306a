"""The operator's commands of `mili` for tenants' quotas and rate limits (docs/operating-the-queue.md).

    mili quota set TENANT [--max-waiting N] [--rpm N] [--tpm N] [--weight W] [--unset NAME...]
    mili quota show [TENANT]

A limit holds on each queue (as OpenAI's hold per model); producers and gateways see a change
within a second. A limit of 0 is refused: `--unset NAME` removes a limit (or the weight).
"""

from __future__ import annotations

import argparse
import sys

from cli.operator_commands import print_table
from producer_client.client import Client
from producer_client.quotas import DEFAULT_WEIGHT, QUOTA_FIELDS, Quota

UNLIMITED = "unlimited"


def add_commands(commands) -> None:
    """Add `quota` (set, show) to the `mili` parser's subcommands."""
    quota = commands.add_parser("quota", help="tenants' quotas and rate limits: set, show")
    actions = quota.add_subparsers(dest="quota_command", required=True)
    change = actions.add_parser("set", help="set (or unset) a tenant's quotas; prints them as they are now")
    change.add_argument("tenant")
    change.add_argument("--max-waiting", type=int, help="jobs nobody has read yet, across the queue's lanes")
    change.add_argument("--rpm", type=int, help="requests per minute, on each queue")
    change.add_argument("--tpm", type=int, help="tokens per minute (prompt estimate + max_tokens), on each queue")
    change.add_argument(
        "--weight", type=float, help="share of a lane's tokens against other tenants', from 0.001 to 1000 (default 1)"
    )
    change.add_argument(
        "--unset", action="append", default=[], choices=QUOTA_FIELDS, metavar="NAME", help="remove a setting"
    )
    change.set_defaults(run=cmd_quota_set)
    show = actions.add_parser("show", help="every tenant's quotas, or one's")
    show.add_argument("tenant", nargs="?")
    show.set_defaults(run=cmd_quota_show)


def cmd_quota_set(client: Client, args: argparse.Namespace) -> int:
    settings = {name: getattr(args, name) for name in QUOTA_FIELDS if getattr(args, name) is not None}
    quota = client.tenant_quotas.set(args.tenant, unset=tuple(args.unset), **settings)
    print_quotas({args.tenant: quota})
    return 0


def cmd_quota_show(client: Client, args: argparse.Namespace) -> int:
    """A tenant whose settings key holds another type is shown as it holds (no limits) and named on
    stderr with its key: `quota show` left it out, and `quota show TENANT` said it had no settings."""
    quotas = client.tenant_quotas.all() if args.tenant is None else {args.tenant: client.tenant_quotas.get(args.tenant)}
    other_type = client.tenant_quotas.of_another_type(None if args.tenant is None else [args.tenant])
    print_quotas(
        quotas | dict.fromkeys(other_type, Quota()), {tenant: client.keys.quota(tenant) for tenant in other_type}
    )
    return 0


def print_quotas(quotas: dict[str, Quota], other_type: dict[str, str] | None = None) -> None:
    """Each tenant's settings as they hold: an unset limit is no limit, an unset weight is 1 (a row
    of dashes told a user nothing about a tenant with none). Such a tenant is named on stderr, as
    is one whose settings key (`other_type`: by tenant) holds another type."""
    other_type = other_type or {}
    rows = [(tenant, *shown_settings(q)) for tenant, q in sorted(quotas.items())]
    print_table(("TENANT", "MAX WAITING", "RPM", "TPM", "WEIGHT"), rows)
    for tenant, quota in sorted(quotas.items()):
        if tenant in other_type:
            print(
                f"({tenant}: {other_type[tenant]} holds another type than the hash MILI writes there: read as no "
                "settings, no limits, until an operator deletes it)",
                file=sys.stderr,
            )
        elif quota == Quota():
            print(f"({tenant} has no settings: no limits, weight {DEFAULT_WEIGHT:g})", file=sys.stderr)


def shown_settings(quota: Quota) -> list[str]:
    """Each setting as it holds, exactly: `:g` wrote a limit of a million `1e+06` and rounded to six
    digits (a TPM of 123456789 read 1.23457e+08). A float's 15 digits are all a weight has."""
    limits = [UNLIMITED if value is None else str(value) for value in (quota.max_waiting, quota.rpm, quota.tpm)]
    return [*limits, f"{DEFAULT_WEIGHT if quota.weight is None else quota.weight:.15g}"]
