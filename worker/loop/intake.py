"""Intake: how a queue entry becomes a job, all in the worker. An entry as delivered (Delivery),
its fields checked and its body parsed (parse_request), its prompt tokenized, a chat's through the
checkpoint's chat template (render_prompt), what its output must match (constraint_of), and the
Job they make (job_from_entry), or the MiliError its failed result will carry."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import cast

from producer_client import structured
from producer_client.chat import tool_names
from producer_client.chat_output import THINK_CLOSE, THINK_OPEN, OutputFormat, Reasoning
from producer_client.errors import InvalidArgument, InvalidBody, MiliError, UnsupportedVersion
from producer_client.keys import DEFAULT_LANE, LANES, NAME_PATTERN, NO_TENANT, PROTOCOL_VERSION, TENANT_PATTERN
from producer_client.new_job import check_grammars
from producer_client.protocol.clock import entry_time
from producer_client.schema import JobRequest
from producer_client.structured import ResponseFormat
from worker.engine.grammar.constraint import Constraint, Thinking, ToolFunction, after_thinking, tool_call_constraint
from worker.engine.interface import EngineTokenizer
from worker.loop.jobs import InternalError, Job
from worker.loop.streams import DEFAULT_ROUTE, Route, owner_of, route_of_ref
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)

# id, v, body: every entry's. cost: what READ charges its tenant (an entry of a lane's stream, or
# placed on a worker's own); lane, tenant: a placed entry's route (a lane's stream names its own).
ENTRY_FIELDS = frozenset({"id", "v", "body", "cost", "lane", "tenant"})
COST = re.compile(r"[0-9]{1,12}")
# A producer's entry may hold any number of fields of any length: the error names a few.
UNKNOWN_FIELDS_SHOWN = 5
NAME_CHARS_SHOWN = 64


@dataclass
class Delivery:
    """A queue entry as this worker received it."""

    entry_id: str
    fields: dict[str, str]
    deliveries: int = 1  # XPENDING's delivery count: 1 for a first read, raised by every reclaim
    handed_over: bool = False  # reclaimed after a draining worker handed it over, not after it went idle
    charged: int = 0  # the tokens READ charged its tenant for it (0 when taken otherwise)
    job_id: str = field(init=False)
    route: Route = field(init=False)

    def __post_init__(self) -> None:
        self.job_id = job_id_of(self.entry_id, self.fields)
        self.route = route_of(self.entry_id, self.fields)


def route_of(entry_id: str, fields: dict[str, str]) -> Route:
    """The lane and tenant of an entry: a lane stream's reference names them, an entry placed on
    a worker's own stream carries them (a malformed one fails its job in parse_request: until
    then it counts as the default route), the queue's own stream's are the default."""
    route = route_of_ref(entry_id)
    if route is not None:
        return route
    if owner_of(entry_id) is None:
        return DEFAULT_ROUTE
    lane, tenant = fields.get("lane", DEFAULT_LANE), fields.get("tenant", NO_TENANT)
    if lane in LANES and (tenant == NO_TENANT or TENANT_PATTERN.fullmatch(tenant)):
        return Route(lane, tenant)
    return DEFAULT_ROUTE


def job_from_entry(
    d: Delivery, run: str, now: float, settings: WorkerSettings, tokenizer: EngineTokenizer
) -> Job | MiliError:
    """The job a claimed entry asks for, as run `run` starting at `now`; or the error it fails with."""
    try:
        request = parse_request(d.fields, settings.max_body_bytes, settings.max_tokens_limit)
        ids, fmt = render_prompt(request, tokenizer)
        constraint = constraint_of(request, fmt, tokenizer)
    except MiliError as e:
        return e
    except Exception as e:  # a bug must cost one job, not the worker
        log.exception("job %s: unexpected error while reading its entry", d.job_id)
        return InternalError(f"{type(e).__name__}: {e}")
    return Job(
        d.job_id,
        d.entry_id,
        run,
        request,
        ids,
        queued_at=entry_time(d.entry_id),
        started_at=now,
        output_format=fmt,
        constraint=constraint,
        route=d.route,
    )


def job_id_of(entry_id: str, fields: dict[str, str]) -> str:
    """The entry's job id; an entry without a usable one is reported under `entry-<entry id>`."""
    job_id = fields.get("id", "")
    return job_id if NAME_PATTERN.fullmatch(job_id) else f"entry-{entry_id}"


def parse_request(fields: dict[str, str], max_body_bytes: int, max_tokens_limit: int) -> JobRequest:
    """The entry's JobRequest, or a MiliError whose code the failed job will carry."""
    if not NAME_PATTERN.fullmatch(fields.get("id", "")):
        raise InvalidBody("the entry has no valid `id` field")
    if fields.get("v") != str(PROTOCOL_VERSION):
        raise UnsupportedVersion(f"protocol version {fields.get('v')!r}; this worker speaks {PROTOCOL_VERSION}")
    unknown = sorted(set(fields) - ENTRY_FIELDS)
    if unknown:
        named = ", ".join(repr(name[:NAME_CHARS_SHOWN]) for name in unknown[:UNKNOWN_FIELDS_SHOWN])
        more = f" and {len(unknown) - UNKNOWN_FIELDS_SHOWN} more" if len(unknown) > UNKNOWN_FIELDS_SHOWN else ""
        raise InvalidBody(f"the entry has fields protocol v{PROTOCOL_VERSION} does not know: {named}{more}")
    if "body" not in fields:
        raise InvalidBody("the entry has no `body` field")
    check_route_fields(fields)
    try:
        # The worker's connection decodes with surrogateescape: invalid bytes surface here.
        body = fields["body"].encode()
    except UnicodeEncodeError:
        raise InvalidBody("the body is not valid UTF-8") from None
    return JobRequest.from_json(body, max_body_bytes, max_tokens_limit)


def check_route_fields(fields: dict[str, str]) -> None:
    """The fields of protocol v1's lanes, where an entry has them (docs/architecture.md)."""
    if "cost" in fields and not COST.fullmatch(fields["cost"]):
        raise InvalidBody("the entry's `cost` is not a whole number of tokens")
    if "lane" in fields and fields["lane"] not in LANES:
        raise InvalidBody(f"the entry's `lane` is not one of {', '.join(LANES)}")
    if "tenant" in fields and not TENANT_PATTERN.fullmatch(fields["tenant"]):
        raise InvalidBody("the entry's `tenant` is not a tenant's name")


def render_prompt(request: JobRequest, tokenizer: EngineTokenizer) -> tuple[list[int], OutputFormat | None]:
    """The prompt's token ids, and for a chat how its output splits. Tokenized here, in the
    worker, so that producers need no tokenizer; chat messages and the tools offered go through
    the checkpoint's own (sandboxed) chat template."""
    if request.input_ids is not None:
        return list(request.input_ids), None
    if request.messages is None:
        return tokenizer.encode(cast(str, request.prompt)), None  # JobRequest holds exactly one of the three
    tools = request.offered_tools()
    text = cast(  # tokenize=False: the text
        str,
        tokenizer.apply_chat_template(
            [m.for_template() for m in request.messages],
            add_generation_prompt=True,
            tokenize=False,
            tools=[t.model_dump(exclude_none=True) for t in tools] or None,
            enable_thinking=request.enable_thinking,
        ),
    )
    fmt = OutputFormat(
        reasoning=reasoning_of(request.enable_thinking, text), tools=tool_names(tools) if tools else None
    )
    # The template writes the special tokens itself, so encoding must not add more.
    return tokenizer.encode(text, add_special_tokens=False), fmt


def constraint_of(request: JobRequest, output: OutputFormat | None, tokenizer: EngineTokenizer) -> Constraint | None:
    """What the job's output must match, if anything: its response_format; the tool calls that
    its tool_choice forces ("required", or a named function); with tools offered under "auto",
    a call or the formatted answer. A chat that thinks is free until its reasoning ends."""
    fmt = request.params.response_format
    forced = bool(request.tools) and request.tool_choice not in (None, "auto", "none")
    if fmt is None and not forced:
        return None
    # A client refused a regex too large to follow at its pace; a producer's raw XADD skips it.
    check_grammars(request, structured.check_size)
    tools = request.offered_tools()
    thinking = thinking_of(output, tokenizer)
    if tools:
        functions = [ToolFunction(t.function.name, t.function.parameters) for t in tools]
        return tool_call_constraint(functions, request.parallel_tool_calls, None if forced else fmt, thinking)
    return Constraint.of_format(fmt, thinking_before(fmt, thinking))


def thinking_of(output: OutputFormat | None, tokenizer: EngineTokenizer) -> Thinking | None:
    """The reasoning block's markers as the vocabulary's tokens, when the chat thinks."""
    if output is None or output.reasoning is Reasoning.OFF:
        return None
    opens, closes = tokenizer.token_to_id(THINK_OPEN), tokenizer.token_to_id(THINK_CLOSE)
    if closes is None:
        return None  # a vocabulary without the markers: the model cannot write the block
    return Thinking(closes, opens if output.reasoning is Reasoning.OPTIONAL else None)


def thinking_before(fmt: ResponseFormat | None, thinking: Thinking | None) -> Thinking | None:
    """The thinking a format's answer may follow: none where each of its answers opens with a
    newline, which the reader drops after a think block (the output then may not open one, and the
    grammar holds from its first token); such a format cannot follow reasoning the prompt opened."""
    if thinking is None or fmt is None or after_thinking(fmt) is not None:
        return thinking
    if thinking.opens is None:
        raise InvalidArgument(
            "response_format", "every answer opens with a newline, which cannot follow the reasoning the prompt opened"
        )
    return None


def reasoning_of(enable_thinking: bool, prompt: str) -> Reasoning:
    """Thinking off: no reasoning. On: the output opens a <think> block, or (as the templates of
    thinking-only models do) the prompt opened it already and the output starts inside it."""
    if not enable_thinking:
        return Reasoning.OFF
    return Reasoning.OPEN if prompt.rstrip().endswith(THINK_OPEN) else Reasoning.OPTIONAL
