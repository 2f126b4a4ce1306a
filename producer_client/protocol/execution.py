"""How any MILI component runs protocol v1's commands: one pipeline per exchange, split per node
on a Redis Cluster (producer_client.cluster), the scripts loaded again where a server answers
NOSCRIPT (fresh, restarted, or SCRIPT FLUSHed: the script did not run, so only what failed is sent
again), and WAIT routed to the node that holds the writes it vouches for."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import redis
import redis.asyncio
from hiredis import pack_command
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.client import CaseInsensitiveDict
from redis.cluster import ClusterNode
from redis.commands.core import CoreCommands
from redis.exceptions import NoScriptError, ResponseError

from producer_client.cluster import (
    NODE_ERRORS,
    AsyncCluster,
    AsyncRedis,
    Cluster,
    SyncRedis,
    is_cluster,
    topology_errors,
)
from producer_client.connection import REDIS_FAILURES, raise_typed, typed_refusal
from producer_client.pooling import ASYNC_EXCHANGE_POOLS, EXCHANGE_POOLS
from producer_client.protocol.producer import PRODUCER_SCRIPTS
from producer_client.protocol.script import Script

# Recorded commands: (arguments, options) each, as redis-py's methods hand them to execute_command.
Stack = list[tuple[tuple[Any, ...], dict[str, Any]]]
# Each command's reply as redis-py parses it, or the error in its place. The one place MILI's
# replies meet their types: redis-py's pipelines type a reply Any (its type is the command's), and
# each protocol read says what its commands answer where it reads them.
Replies = list[Any]
Node = ClusterNode | AsyncClusterNode  # a cluster's node, sync or asyncio
Waits = dict[int, tuple[str, Node]]  # each WAIT's place in a cluster's pipeline: its key, and its node
T = TypeVar("T")


class Commands(CoreCommands):
    """What a caller adds to a pipeline, recorded as redis-py's command methods spell it (arguments,
    and the options that parse the reply) and sent by `execute`: so the commands NOSCRIPT refused
    can be sent again, whatever kind of pipeline carried them (a cluster's stores them its own way).
    EVALSHA, TIME and the rest are recorded alike: redis-py's cluster pipeline refuses their
    methods, not the commands.
    redis-py's CommandsProtocol, which its command methods take as `self`, declares a client's
    `_event_dispatcher`, which none of those methods reads: a recorder has none, and mypy counts
    it abstract (the `type: ignore[type-abstract]` where one is made: `recorder`)."""

    stack: Stack  # set by `recorder`

    def execute_command(self, *args: Any, **options: Any) -> Commands:
        self.stack.append((args, options))
        return self

    def wait_replicas(self, key: str, replicas: int, timeout_ms: int) -> Commands:
        """WAIT on the node that holds `key`, after the writes added before it: WAIT counts the
        replicas that have this connection's writes, so on a cluster it goes to that node's."""
        self.stack.append((("WAIT", replicas, timeout_ms), {_NODE_OF: key}))
        return self

    def last_unless_refused(self, add: Callable[[Commands], object]) -> Commands:
        """The one command `add` records, the exchange's last, whose reply is read only where no
        command before it was refused (an error reply); else the connection is closed and the reply
        is None. For a blocking read whose wait a refusal makes moot (a job's first read of its end,
        after its enqueue): Redis runs a pipeline's commands in order, so the read would wait out
        its whole block for a job never enqueued; Redis ends a closed connection's block. On one
        server: a cluster's pipeline goes per node, in no order between them, and reads it as any."""
        add(self)
        args, options = self.stack[-1]
        self.stack[-1] = (args, {**options, _UNLESS_REFUSED: True})
        return self


def recorder() -> Commands:
    """An empty Commands: its stack set on an instance made without an __init__ of Python, whose
    call goes through CPython's slow path for a class's __init__ (some 3k instructions an exchange)."""
    commands = Commands.__new__(Commands)  # type: ignore[type-abstract]  # see Commands
    commands.stack = []
    return commands


SCRIPT_RELOADS = 3  # rounds of load-and-resend for the EVALSHAs that met NOSCRIPT (_reloaded)
# What a caller adds commands to: a Commands, typed Any because redis-py's command stubs take only
# a client as `self`; and what it hands `execute`, which adds one exchange's commands to one.
Pipe = Any
AddCommands = Callable[[Pipe], None]

_NODE_OF = "mili_node_of"  # a recorded command's key whose node must run it; never sent
_UNLESS_REFUSED = "mili_unless_refused"  # Commands.last_unless_refused's mark; never sent
_MARKS = frozenset({_NODE_OF, _UNLESS_REFUSED})
# The option redis-py's read commands record for its client-side cache (HGET's, EXISTS', XREAD's
# keys), which parse_response drops: a command with no other option is read as a plain one.
_CACHE_KEYS = frozenset({"keys"})
# Commands of several keys that answer a count: a cluster runs a command only on keys of one
# slot, so there each of these goes out once per slot of its keys, and the counts are added up
# (as redis-py's cluster client does for its own exists() and delete(), which a pipeline lacks).
COUNTED_PER_KEY = frozenset({"EXISTS", "DEL", "UNLINK", "TOUCH"})


def execute(
    client: SyncRedis,
    add_commands: Callable[[Pipe], object],
    scripts: Sequence[Script] = (),
    raise_on_error: bool = True,
    repeatable: bool = False,
) -> Replies:
    """Record commands with `add_commands` and send them in one pipeline; on a cluster, redis-py
    splits it per node, one round trip to every node at once, and follows MOVED and ASK. A server
    that lacks our scripts (fresh, restarted, SCRIPT FLUSHed, or a replica just promoted) answers
    NOSCRIPT to each EVALSHA, which then did not run, while the pipeline's other commands did: so
    the scripts are loaded (on every master of a cluster) and only the EVALSHAs that failed are
    sent again, for up to SCRIPT_RELOADS rounds if the server loses them again. Nothing runs
    twice, which matters for commands that are not safe to repeat (an XREADGROUP sent twice would
    leave the first read's entries pending and unknown to the caller).
    With `raise_on_error=False` a command's error is its reply, for the caller to judge one by
    one; otherwise the first error is raised. `scripts`: those the pipeline may run, beside the
    producers' own. `repeatable`: the commands are safe to run twice (reads, a DEL), so on a
    cluster a command that a node failed (redis-py tries it again at once, then gives its error as
    the reply) fails the round trip, which the client's retry policy sends again, as it does a
    single command's, until the failover is over."""
    commands = recorder()
    add_commands(commands)
    stack = commands.stack
    try:
        if is_cluster(client):
            with topology_errors():
                replies = _send(client, stack, repeatable)
        else:
            # One server raises no cluster's errors: the exchange alone, no context of topology_errors.
            replies = _exchange(client, stack)
        missing = _lacking_scripts(replies)
        if missing:  # NOSCRIPT: the reload is off the way of every exchange that met none
            _reloaded(client, stack, replies, missing, scripts)
    except REDIS_FAILURES as e:
        raise_typed(e, client, [args for args, _ in stack])
    return _checked(replies) if raise_on_error else replies


async def aexecute(
    client: AsyncRedis,
    add_commands: Callable[[Pipe], object],
    scripts: Sequence[Script] = (),
    raise_on_error: bool = True,
    repeatable: bool = False,
) -> Replies:
    """`execute` for a redis.asyncio client."""
    commands = recorder()
    add_commands(commands)
    stack = commands.stack
    try:
        if is_cluster(client):
            with topology_errors():
                if any(_NODE_OF in options for _, options in stack):
                    await client.initialize()  # the slot table, to route each WAIT to its node; once per client
                replies = await _asend(client, stack, repeatable)
        else:
            replies = await _aexchange(client, stack)
        missing = _lacking_scripts(replies)
        if missing:
            await _areloaded(client, stack, replies, missing, scripts)
    except REDIS_FAILURES as e:
        raise_typed(e, client, [args for args, _ in stack])
    return _checked(replies) if raise_on_error else replies


def _reloaded(client: SyncRedis, stack: Stack, replies: Replies, missing: list[int], scripts: Sequence[Script]) -> None:
    """`replies`, each NOSCRIPT at `missing` replaced by the reply of its EVALSHA sent again once the
    scripts are loaded (on every master of a cluster), for up to SCRIPT_RELOADS rounds: a server can
    lose them again between the load and the resend (two SCRIPT FLUSHes in a row, a failover after
    a failover). One that loses them every round is being flushed on purpose; its NOSCRIPT is the reply."""
    with topology_errors():
        for _ in range(SCRIPT_RELOADS):
            load_scripts(client, scripts)
            _splice(replies, missing, _send(client, [stack[i] for i in missing]))
            missing = _lacking_scripts(replies)
            if not missing:
                return


async def _areloaded(
    client: AsyncRedis, stack: Stack, replies: Replies, missing: list[int], scripts: Sequence[Script]
) -> None:
    """`_reloaded` for a redis.asyncio client."""
    with topology_errors():
        for _ in range(SCRIPT_RELOADS):
            await aload_scripts(client, scripts)
            _splice(replies, missing, await _asend(client, [stack[i] for i in missing]))
            missing = _lacking_scripts(replies)
            if not missing:
                return


def load_scripts(client: SyncRedis, scripts: Sequence[Script] = ()) -> None:
    """Load the producers' scripts and `scripts`, on every master of a cluster."""
    try:
        with topology_errors():
            # The masters are named anew for each try: after a failover the old one answers no more.
            _checked(_send(client, lambda: _script_loads(client, scripts)))
    except REDIS_FAILURES as e:
        raise_typed(e, client, [("SCRIPT LOAD",)])


async def aload_scripts(client: AsyncRedis, scripts: Sequence[Script] = ()) -> None:
    """`load_scripts` for a redis.asyncio client."""
    try:
        with topology_errors():
            _checked(await _asend(client, lambda: _script_loads(client, scripts)))
    except REDIS_FAILURES as e:
        raise_typed(e, client, [("SCRIPT LOAD",)])


def _script_loads(client: SyncRedis | AsyncRedis, scripts: Sequence[Script]) -> Stack:
    masters: list[Node | None] = [*client.get_primaries()] if is_cluster(client) else [None]
    return [
        (("SCRIPT LOAD", script.source), {} if node is None else {"target_nodes": node})
        for node in masters
        for script in (*PRODUCER_SCRIPTS, *scripts)
    ]


def _send(client: SyncRedis, stack: Stack | Callable[[], Stack], repeatable: bool = False) -> Replies:
    """One reply (or error) per command of `stack` (or of the stack it makes), in one pipeline: on
    a cluster, built anew for each try of the client's pacing (redis-py's own empties a pipeline
    it sent), each command routed by the topology of that try; a `repeatable` one is tried again
    while a node fails any of its commands (see execute). On one server, `_exchange`."""
    if not is_cluster(client):
        return _exchange(client, stack() if callable(stack) else stack)

    def attempt() -> Replies:
        sent = stack() if callable(stack) else stack
        pipe, parts, waits = _cluster_pipeline(client, sent)
        replies = _typed_refusals(
            _judged_waits(client, _folded(pipe.execute(raise_on_error=False), parts), waits), sent
        )
        return _node_errors_raised(replies) if repeatable else replies

    return client.paced(attempt)


async def _asend(client: AsyncRedis, stack: Stack | Callable[[], Stack], repeatable: bool = False) -> Replies:
    if not is_cluster(client):
        return await _aexchange(client, stack() if callable(stack) else stack)

    async def attempt() -> Replies:
        sent = stack() if callable(stack) else stack
        pipe, parts, waits = _cluster_pipeline(client, sent)
        replies = await pipe.execute(raise_on_error=False)
        replies = _typed_refusals(_judged_waits(client, _folded(replies, parts), waits), sent)
        return _node_errors_raised(replies) if repeatable else replies

    return await client.paced(attempt)


def _exchange(client: redis.Redis, stack: Stack) -> Replies:
    """One round trip of `stack` to one server, as redis-py's pipeline makes it (one write of every
    command packed, then each reply read, a command's error in its place; the connection closed
    after a failure, and the whole exchange tried again as the connection's retry policy says)
    without the pipeline object and its per-call records, a good part of a submit's CPU (bench/
    RESULTS.md, "The producer's own cost"). The first try is made outside the policy, which
    takes over only after it failed (_after_failed_try): no retry layer on the way of an exchange
    that succeeds. The connection is taken as it is (producer_client.pooling): each try connects
    it once if it is not, so the policy's tries are the call's, its connects too. No command, no
    connection (as redis-py's pipeline)."""
    if not stack:
        return []
    pool: Any = client.connection_pool
    ours = type(pool) in EXCHANGE_POOLS
    connection = pool.take() if ours else pool.get_connection()
    try:
        try:
            return _round_trip(client, connection, stack)
        except Exception as error:
            retried = _after_failed_try(error, lambda: _round_trip(client, connection, stack))
            replies: Replies = connection.retry.call_with_retry(retried, lambda _: connection.disconnect())
            return replies
    except BaseException:
        # A reply whose parsing raised (a callback's error, an interrupt) leaves the later ones
        # unread, which redis-py's checkout does not count as dirty while its maintenance
        # notifications are on (its default): the next call would read them as its own.
        connection.disconnect()
        raise
    finally:
        if ours:
            pool.give_back(connection)
        else:
            pool.release(connection)


async def _aexchange(client: redis.asyncio.Redis, stack: Stack) -> Replies:
    """`_exchange` for a redis.asyncio client."""
    if not stack:
        return []
    pool: Any = client.connection_pool
    ours = type(pool) in ASYNC_EXCHANGE_POOLS
    connection = await (pool.take() if ours else pool.get_connection())
    try:
        try:
            return await _around_trip(client, connection, stack)
        except Exception as error:
            retried = _after_failed_try(error, lambda: _around_trip(client, connection, stack))
            replies: Replies = await connection.retry.call_with_retry(retried, lambda _: connection.disconnect())
            return replies
    except BaseException:
        await connection.disconnect()  # replies left unread (see _exchange)
        raise
    finally:
        await (pool.give_back(connection) if ours else pool.release(connection))


def _after_failed_try(error: Exception, attempt: Callable[[], T]) -> Callable[[], T]:
    """`attempt` as a retry policy's tries after a first try, made outside it, that failed with
    `error`: the policy's own first try raises that error, so the policy judges it (retry it, or
    let it through), runs its failure handler, counts it and backs off exactly as if it had made
    that try itself."""
    failed = [error]

    def tried() -> T:
        if failed:
            raise failed.pop()
        return attempt()

    return tried


def _round_trip(client: redis.Redis, connection: Any, stack: Stack) -> Replies:
    """Send `stack` and read a reply for each command, as redis-py parses it, or the error in its
    place (_refused). A recorded command's options go to the parser as they are, but a WAIT's
    (_sent_options): a function call per reply less, on every round trip of every component."""
    connection.send_packed_command(_packed(connection, stack))
    replies: Replies = []
    callbacks = client.response_callbacks
    # redis-py's callbacks are a CaseInsensitiveDict, whose keys it upper-cases as it stores them;
    # its get() is a Python call of every reply: the name is upper-cased here and looked up by dict's.
    upper_keys = type(callbacks) is CaseInsensitiveDict
    for args, options in stack:
        try:
            if options.keys() <= _CACHE_KEYS:
                # No option that steers its read (a submit's two commands, most of a worker's): read,
                # then the client's callback for its name where there is one, as parse_response does
                # for it, without its option handling and with one case-insensitive lookup of the
                # callback, not two: a Python call a reply less. Inline: a function would be one more.
                response = connection.read_response()
                callback = dict.get(callbacks, args[0].upper()) if upper_keys else callbacks.get(args[0])
                replies.append(response if callback is None else callback(response))
            elif _UNLESS_REFUSED in options and _any_refused(replies):
                connection.disconnect()  # rather than wait for its reply: see Commands.last_unless_refused
                replies.append(None)
            else:
                sent = _sent_options(options) if _NODE_OF in options or _UNLESS_REFUSED in options else options
                replies.append(client.parse_response(connection, args[0], **sent))
        except ResponseError as e:
            replies.append(_refused(args, options, e))
    return replies


async def _around_trip(client: redis.asyncio.Redis, connection: Any, stack: Stack) -> Replies:
    await connection.send_packed_command(_packed(connection, stack))
    replies: Replies = []
    for args, options in stack:
        if _UNLESS_REFUSED in options and _any_refused(replies):
            await connection.disconnect()  # see _round_trip
            replies.append(None)
            continue
        try:
            sent = _sent_options(options) if _NODE_OF in options or _UNLESS_REFUSED in options else options
            replies.append(await client.parse_response(connection, args[0], **sent))
        except ResponseError as e:
            replies.append(_refused(args, options, e))
    return replies


def _any_refused(replies: Replies) -> bool:
    return any(isinstance(reply, Exception) for reply in replies)


def _refused(args: tuple[Any, ...], options: dict[str, Any], error: ResponseError) -> Any:
    """What a command's error reply stands for: the error, in the command's place, MILI's typed
    error where it has one (connection.typed_refusal: NOPERM, OOM, READONLY, naming the command);
    but a WAIT whose node refused it (a master turned replica) vouches for nothing: 0."""
    if _NODE_OF in options:
        return 0
    return typed_refusal(args, error)


def _packed(connection: Any, stack: Stack) -> list[bytes]:
    """The commands of `stack` in the Redis protocol, as redis-py's connection packs them (with
    hiredis, a dependency, it calls hiredis for each command after a Python pass over its
    arguments), by hiredis directly, in one buffer. A command with an argument hiredis does not
    take (a bytearray, None) goes through redis-py's packer, which converts it or raises its
    DataError."""
    try:
        # A name of two words is split (_words). A name given as bytes raises TypeError here: redis-py's packer.
        # A loop, not a comprehension, whose frame (Python 3.11) costs more than this loop over an
        # exchange's few commands: every exchange of every component packs.
        parts: list[bytes] = []
        for args, _ in stack:
            parts.append(pack_command(_words(args) if " " in args[0] else args))
        return [b"".join(parts)]
    except TypeError:
        packed: list[bytes] = connection.pack_commands([args for args, _ in stack])
        return packed


def _words(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A command's arguments with its name, of two words ("SCRIPT LOAD"), split, as redis-py sends them."""
    return (*args[0].split(), *args[1:])


def _sent_options(options: dict[str, Any]) -> dict[str, Any]:
    """A command's recorded options as redis-py reads its reply with them: without our marks."""
    return {k: v for k, v in options.items() if k not in _MARKS}


def _cluster_pipeline(client: Cluster | AsyncCluster, stack: Stack) -> tuple[Any, list[int], Waits]:
    """A cluster pipeline of `stack`'s commands; how many went out for each (more than one for a
    command of COUNTED_PER_KEY whose keys lie in several slots); and for each WAIT, by its place in
    `stack`, its key and the node it was sent to."""
    pipe = client.pipeline(transaction=False)
    parts: list[int] = []
    waits: Waits = {}
    for at, (args, options) in enumerate(stack):
        if _NODE_OF in options:
            options = dict(options)
            key = options.pop(_NODE_OF)
            waits[at] = (key, _master_of(client, key))
            options["target_nodes"] = waits[at][1]
        elif _UNLESS_REFUSED in options:
            options = _sent_options(options)  # read as any command (Commands.last_unless_refused)
        sent = _as_sent(client, args, options)
        for command_args, command_options in sent:
            pipe.execute_command(*command_args, **command_options)
        parts.append(len(sent))
    return pipe, parts, waits


def _as_sent(client: Cluster | AsyncCluster, args: tuple[Any, ...], options: dict[str, Any]) -> Stack:
    """The commands a cluster client sends for one recorded command."""
    if str(args[0]).upper() not in COUNTED_PER_KEY:
        return [(args, options)]
    by_slot: dict[int, list[Any]] = {}
    for key in args[1:]:
        by_slot.setdefault(client.keyslot(key), []).append(key)
    return [((args[0], *keys), options) for keys in by_slot.values()]


def _judged_waits(client: Cluster | AsyncCluster, replies: Replies, waits: Waits) -> Replies:
    """`replies`, with 0 (no replica confirmed anything) for each WAIT that cannot vouch for the
    writes before it: one its node refused (the node turned replica in a failover), and on a
    cluster one whose key's slot another node serves now (the writes followed MOVED there, on
    another connection, while the WAIT went to the node the topology named before). A write an
    ASK sent to the node importing its slot, in the middle of a resharding, is not seen here: the
    WAIT then speaks for the writes that stayed on its node only."""
    for at, (key, node) in waits.items():
        refused = isinstance(replies[at], ResponseError)
        if refused or _master_of(client, key).name != node.name:
            replies[at] = 0
    return replies


def _master_of(client: Cluster | AsyncCluster, key: str) -> Node:
    """The master that serves `key`'s slot now (SlotNotCoveredError if none does). redis-py types
    get_node_from_key's answer Optional: None answers only an ask for a replica."""
    return cast(Node, client.get_node_from_key(key))


def _folded(replies: Replies, parts: list[int]) -> Replies:
    """The replies of the commands `_pipeline` split, one per command of the stack again: the sum
    of its counts, or the first error among them."""
    folded: Replies = []
    at = 0
    for count in parts:
        mine = replies[at : at + count]
        at += count
        errors = [reply for reply in mine if isinstance(reply, Exception)]
        folded.append(mine[0] if count == 1 else errors[0] if errors else sum(mine))
    return folded


def _node_errors_raised(replies: Replies) -> Replies:
    """`replies`, once none is a node's failure (NODE_ERRORS): the first such is raised."""
    for reply in replies:
        if isinstance(reply, NODE_ERRORS):
            raise reply
    return replies


def _typed_refusals(replies: Replies, stack: Stack) -> Replies:
    """`replies` of a cluster's pipeline of `stack`, each error reply typed as _refused types one
    server's as it reads them (connection.typed_refusal)."""
    return [
        typed_refusal(args, reply) if isinstance(reply, ResponseError) else reply
        for (args, _), reply in zip(stack, replies)
    ]


def _lacking_scripts(replies: Replies) -> list[int]:
    # A loop, not a comprehension, whose frame (Python 3.11) costs more than this loop over an
    # exchange's few replies: every exchange of every component asks.
    missing = []
    for i, reply in enumerate(replies):
        if isinstance(reply, NoScriptError):
            missing.append(i)
    return missing


def _splice(replies: Replies, positions: list[int], again: Replies) -> None:
    for i, reply in zip(positions, again):
        replies[i] = reply


def _checked(replies: Replies) -> Replies:
    """`replies`, raising the first error among them."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies
