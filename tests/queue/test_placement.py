"""Cache-aware placement (docs/architecture.md): how a producer keys and places a job (no Redis):
every turn of a conversation keyed by its root whatever the form it comes in, then the real worker
loop on a real redis-server: placed jobs run on the worker they were placed on, entries placed on a
stalled worker are stolen after steal_delay_ms, a dead worker's are reclaimed and resumed, and
either side can turn placement off."""

from __future__ import annotations

import functools
import math
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest
import redis
import redis.exceptions

from harness.echo_workers import GatedWorker, serving
from harness.polling import eventually
from producer_client import BulkQueueFull, Client, bulk, roots, steps
from producer_client.errors import InvalidQueueStream, JobTimeout, UnknownAdapter
from producer_client.keys import GROUP, NO_TENANT, Keys
from producer_client.new_job import build_job
from producer_client.operations import enqueue_commands
from producer_client.placement import (
    Candidate,
    Placed,
    Placement,
    View,
    candidates_from,
    prefix_key,
    rendezvous_score,
    served_adapters,
)
from producer_client.protocol import execution
from producer_client.protocol.replies import is_entry_id
from producer_client.roots import PREFIX_CHARS, PREFIX_IDS
from producer_client.schema import JobRequest, JobResult
from producer_client.waiting import MAX_BLOCK_MS
from tests.queue.test_redis_errors import WRITES_REFUSED
from tests.support.fixtures import on_modes
from tests.support.jobs import assert_one_final_result, tokens_published
from worker.embedded_redis import EmbeddedRedis, free_port
from worker.model.presets import resolve_model_path
from worker.model.qwen_tokenizer import load_qwen_ranks
from worker.model.tokenizer import Tokenizer

pytestmark = pytest.mark.waits

KEYS = Keys()
SYSTEM = {"role": "system", "content": "You are a terse assistant. " * 8}


def request(**fields) -> JobRequest:
    return JobRequest.model_validate(fields)


def chat(first: str, *later: str) -> JobRequest:
    messages = [SYSTEM, {"role": "user", "content": first}]
    for i, text in enumerate(later):
        messages += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": text}]
    return request(messages=messages)


# -- keys and choices, no Redis ---------------------------------------------------------------------


def test_every_turn_of_a_conversation_is_keyed_by_its_root():
    first = prefix_key(chat("plan a trip"))
    assert prefix_key(chat("plan a trip", "to Lyon", "by train")) == first
    assert prefix_key(chat("plan a dinner")) != first
    assert (
        prefix_key(request(messages=[{**SYSTEM, "content": "other"}, {"role": "user", "content": "plan a trip"}]))
        != first
    )


# A growing conversation: each turn's prompt is the one before, its answer and the next user text.
USERS = ["plan a trip", "to Lyon, by train", "and back on Sunday evening"]
SHORT_ANSWERS = [" Where to?", " The 9:04 from Paris.", " Booked."]
LONG_ANSWERS = [" " + "a long answer, " * 80, " " + "a longer answer, " * 60, " done"]  # turn 2 is over 1,024 chars
PLAIN = ("{}\n", "User: {}\nAssistant:", "\n")  # system prompt, user turn, after an answer


def growing(form: tuple[str, str, str], system: str, users: list[str], answers: list[str]) -> list[str]:
    opening, turn, after_answer = form
    text, prompts = opening.format(system) if system else "", []
    for user, answer in zip(users, answers):
        text += turn.format(user)
        prompts.append(text)
        text += answer + after_answer
    return prompts


def assert_around_the_old_window(sizes: list[tuple[int, int]], answers: list[str]) -> None:
    """Each turn's (characters, ids): with short answers every turn is under main's old window (1,024
    characters, 256 ids), with long ones the first turn is and the others are over both."""
    under = [chars < PREFIX_CHARS and ids < PREFIX_IDS for chars, ids in sizes]
    over = [chars > PREFIX_CHARS and ids > PREFIX_IDS for chars, ids in sizes]
    assert (under, over) == (
        ([True] * 3, [False] * 3) if answers is SHORT_ANSWERS else ([True, False, False], [False, True, True])
    )


def keys_of(**forms: list) -> set[bytes]:
    return {prefix_key(request(**{field: value})) for field, values in forms.items() for value in values}


@pytest.mark.parametrize("system", ["", "You are a terse assistant."], ids=["no-system", "system"])
@pytest.mark.parametrize("answers", [SHORT_ANSWERS, LONG_ANSWERS], ids=["under-1024", "over-1024"])
def test_every_turn_of_a_plain_prompt_conversation_has_one_key(system, answers):
    prompts = growing(PLAIN, system, USERS, answers)
    if answers is SHORT_ANSWERS:
        assert len(prompts[-1]) < PREFIX_CHARS
    else:
        assert len(prompts[0]) < PREFIX_CHARS < len(prompts[1])
    assert len(keys_of(prompt=prompts)) == 1
    # Another conversation: another first line (one that shares the first line shares the key).
    other = growing(PLAIN, system.replace("terse", "chatty"), ["plan a dinner", *USERS[1:]], answers)
    assert keys_of(prompt=other) != keys_of(prompt=prompts)


def test_a_plain_prompt_is_keyed_by_its_first_line_up_to_1024_characters():
    # A first turn of one line, and later turns after line breaks.
    assert len(keys_of(prompt=["Plan a trip", "Plan a trip\nTo where?\nLyon", "Plan a trip\r\nTo where?"])) == 1
    # Blank lines before it are no root of their own.
    assert keys_of(prompt=["\n\nPlan a trip\nsure"]) != keys_of(prompt=["\n\nPlan a dinner\nsure"])
    # Conversations that open with the same line share a key (the load bound spreads them), others do not.
    system = "You are a terse assistant."
    assert len(keys_of(prompt=[f"{system}\nUser: plan a trip", f"{system}\nUser: plan a dinner"])) == 1
    assert len(keys_of(prompt=[f"{system}\nUser: plan a trip", "You are a chatty one.\nUser: plan a trip"])) == 2
    # A first line over the window is keyed by its first 1,024 characters.
    head = "x" * PREFIX_CHARS
    assert len(keys_of(prompt=[head + "one ending", head + "another\nline"])) == 1
    assert len(keys_of(prompt=["a" + head, "b" + head])) == 2


@pytest.fixture(scope="module")
def qwen3() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model_path("tiny"))


def chat_turns(system: str, users: list[str], answers: list[str]) -> list[list[dict[str, str]]]:
    """Each turn's messages."""
    history = [{"role": "system", "content": system}] if system else []
    turns = []
    for user, answer in zip(users, answers):
        history.append({"role": "user", "content": user})
        turns.append(list(history))
        history.append({"role": "assistant", "content": answer})
    return turns


WEATHER_TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("system", ["", "You are a terse assistant."], ids=["no-system", "system"])
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]], ids=["no-tools", "tools"])
@pytest.mark.parametrize("thinking", [False, True], ids=["no-thinking", "thinking"])
def test_every_turn_of_a_chat_has_one_key_as_messages_as_templated_text_and_as_ids(qwen3, system, tools, thinking):
    def as_text(answers: list[str], users: list[str] = USERS) -> list[str]:
        return [
            qwen3.apply_chat_template(messages, tools=tools, enable_thinking=thinking)
            for messages in chat_turns(system, users, answers)
        ]

    for answers in (SHORT_ANSWERS, LONG_ANSWERS):
        texts = as_text(answers)
        assert_around_the_old_window([(len(t), len(qwen3.encode(t))) for t in texts], answers)
        assert len({prefix_key(request(messages=m, tools=tools)) for m in chat_turns(system, USERS, answers)}) == 1
        assert len(keys_of(prompt=texts)) == 1
        assert len(keys_of(input_ids=[qwen3.encode(t) for t in texts])) == 1
    other = as_text(SHORT_ANSWERS, ["plan a dinner", *USERS[1:]])
    assert keys_of(prompt=other) != keys_of(prompt=as_text(SHORT_ANSWERS))
    assert keys_of(input_ids=[qwen3.encode(t) for t in other]) != keys_of(
        input_ids=[qwen3.encode(t) for t in as_text(SHORT_ANSWERS)]
    )


def test_a_templated_first_turn_not_yet_closed_has_the_key_of_the_closed_one():
    opened = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nplan a trip"
    assert len(keys_of(prompt=[opened, opened + "<|im_end|>\n<|im_start|>assistant\n"])) == 1


def bare_ids_turns(qwen3: Tokenizer, system: str, answers: list[str]) -> list[list[int]]:
    """A plain-prompt conversation in ids, grown as a client that keeps ids grows it: the answer's
    ids, then the next user text's, appended."""
    opening, turn, after_answer = PLAIN
    ids, turns = qwen3.encode(opening.format(system)) if system else [], []
    for user, answer in zip(USERS, answers):
        ids = ids + qwen3.encode(turn.format(user))
        turns.append(ids)
        ids = ids + qwen3.encode(answer) + qwen3.encode(after_answer)
    return turns


@pytest.mark.parametrize("system", ["", "You are a terse assistant."], ids=["no-system", "system"])
def test_every_turn_of_a_conversation_in_bare_ids_has_the_key_of_its_first_line(qwen3, system):
    for answers in (SHORT_ANSWERS, LONG_ANSWERS):
        turns = bare_ids_turns(qwen3, system, answers)
        assert turns[0][0] != roots.IM_START_ID and len(turns[0]) < PREFIX_IDS
        texts = growing(PLAIN, system, USERS, answers)
        assert_around_the_old_window([(len(text), len(ids)) for text, ids in zip(texts, turns)], answers)
        retokenized = [qwen3.encode(text) for text in texts]
        assert len(keys_of(input_ids=turns + retokenized)) == 1
    # A line break that tokenizes with what follows it ("\n" or "\n\n") ends the same line.
    assert len(keys_of(input_ids=[qwen3.encode("plan a trip\nsure"), qwen3.encode("plan a trip\n\nsure")])) == 1
    assert len(keys_of(input_ids=[qwen3.encode("plan a trip\nsure"), qwen3.encode("plan a dinner\nsure")])) == 2
    line = qwen3.encode(" plan" * PREFIX_IDS)  # a line of 256 ids
    assert len(line) == PREFIX_IDS and not roots.LINE_END_IDS & set(line)
    assert len(keys_of(input_ids=[line + [1], line + [2]])) == 1
    assert len(keys_of(input_ids=[[1, *line], [2, *line]])) == 2


def test_the_root_of_each_form(qwen3):
    assert roots.text_root("\n\nUser: plan a trip\nAssistant: Where to?\nUser: Lyon") == "\n\nUser: plan a trip"
    assert roots.text_root("x" * 2000 + "\ny") == "x" * PREFIX_CHARS
    templated = qwen3.apply_chat_template(chat_turns("be brief", USERS, SHORT_ANSWERS)[1])
    root = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nplan a trip"
    assert roots.text_root(templated) == root
    assert roots.ids_root(qwen3.encode(templated)) == qwen3.encode(root)
    starts_with_a_break = qwen3.apply_chat_template(chat_turns("", ["\nplan a trip", "and back"], SHORT_ANSWERS)[1])
    assert roots.ids_root(qwen3.encode(starts_with_a_break)) == qwen3.encode("<|im_start|>user\n\nplan a trip")
    assert roots.ids_root(qwen3.encode("User: plan a trip?\nAssistant:")) == qwen3.encode("User: plan a trip")
    assert roots.ids_root(qwen3.encode(" plan" * 1000 + "\n")) == qwen3.encode(" plan" * PREFIX_IDS)


def test_the_roots_markers_and_line_ends_are_qwen3s(qwen3):
    backend = qwen3.backend
    assert [backend.token_to_id(roots.IM_START), backend.token_to_id(roots.IM_END)] == [
        roots.IM_START_ID,
        roots.IM_END_ID,
    ]
    assert qwen3.encode(roots.FIRST_USER)[:2] == [roots.IM_START_ID, roots.USER_ID]
    ranks = load_qwen_ranks()
    # Every token that holds a line break ends with one (Qwen3's pre-tokenizer): each ends a line.
    assert roots.LINE_END_IDS == {rank for token, rank in ranks.items() if token.endswith((b"\n", b"\r"))}
    assert roots.LINE_END_IDS == {rank for token, rank in ranks.items() if set(token) & set(b"\r\n")}


def test_a_job_on_a_lora_adapter_is_keyed_by_its_adapter_alone():
    sql = prefix_key(request(prompt="one", adapter="sql"))
    assert prefix_key(request(messages=chat("plan a trip").messages, adapter="sql")) == sql
    assert prefix_key(request(prompt="one", adapter="chat")) != sql
    assert prefix_key(request(prompt="one")) != sql


def test_a_hot_adapters_jobs_stay_on_its_worker_up_to_the_bound_then_spread():
    key = prefix_key(request(prompt="any", adapter="hot"))
    v = view(0, 0, 0, 0, slots=64)
    order = order_of(v, key)
    placed = [Placement()._place(v, key, KEYS, "q") for _ in range(200)]
    owners = [stream.rsplit("|", 1)[-1].rstrip("}") for stream in placed]
    assert owners[:32] == [order[0]] * 32  # least load + 32 is the bound while the others are idle
    counts = [owners.count(name) for name in order]
    # Then every worker takes a share, none above the bound: 1.25 x the mean once that is the higher.
    assert min(counts) > 0 and max(counts) <= math.ceil(1.25 * 200 / 4)


def test_the_view_says_which_adapters_the_queues_serving_workers_serve():
    beats = [
        {"queue": "q", "state": "serving", "adapters": "a,b"},
        {"queue": "q", "state": "serving"},  # serves none
        {"queue": "q", "state": "draining", "adapters": "c"},
        {"queue": "other", "state": "serving", "adapters": "d"},
        {},  # expired
    ]
    assert served_adapters(beats, "q") == {"a", "b"}
    assert served_adapters(beats[3:], "q") is None  # no live worker of the queue: nothing is known


def test_a_producer_refuses_an_adapter_no_live_worker_serves_and_lets_one_through_when_it_cannot_know():
    placement = Placement(enabled=False)  # the check reads the view whether placement is on or off
    placement.views["q"] = View(time.monotonic(), [], frozenset({"sql"}))
    steps.run(None, placement.check_adapters(KEYS, "q", ["sql", None]))  # a fresh view: no round trip
    with pytest.raises(UnknownAdapter) as e:
        steps.run(None, placement.check_adapters(KEYS, "q", ["sql", "chat"]))
    assert e.value.message == "no LoRA adapter named 'chat' is served by the live workers of queue 'q'"
    placement.views["q"] = View(time.monotonic(), [], None)
    steps.run(None, placement.check_adapters(KEYS, "q", ["chat"]))


def first_choices(names: list[str], keys: list[bytes]) -> list[str]:
    return [max(names, key=lambda n: rendezvous_score(k, n)) for k in keys]


def test_a_worker_leaving_moves_only_the_keys_it_held_and_spreads_them():
    keys = [i.to_bytes(4, "big") for i in range(2000)]
    names = [f"w{i}" for i in range(5)]
    before = first_choices(names, keys)
    after = first_choices([n for n in names if n != "w2"], keys)
    assert all(a == b for a, b in zip(after, before) if b != "w2")
    moved = [a for a, b in zip(after, before) if b == "w2"]
    assert {n: moved.count(n) for n in names if n != "w2"} == pytest.approx(
        {n: len(moved) / 4 for n in names if n != "w2"}, rel=0.3
    )
    assert all(300 <= before.count(n) <= 500 for n in names)  # 400 each on average


def view(*loads: int, slots: int = 256) -> View:
    return View(time.monotonic(), [Candidate(f"w{i}", slots, load) for i, load in enumerate(loads)])


def order_of(v: View, key: bytes) -> list[str]:
    return sorted((c.name for c in v.candidates), key=lambda n: rendezvous_score(key, n), reverse=True)


def loaded(key: bytes, *loads: int, slots: int = 256) -> View:
    """Three or two workers whose loads are given in the key's rendezvous order."""
    names = order_of(view(*loads), key)
    return View(0, [Candidate(name, slots, load) for name, load in zip(names, loads)])


def test_a_job_goes_to_its_first_choice_while_that_one_is_under_the_bound():
    key = b"conversation"
    first, second, third = order_of(view(0, 0, 0), key)
    assert view(0, 0, 0).choose(key).name == first
    # The bound is the higher of ceil(1.25 x mean load, this job included) and the least load + 32.
    assert loaded(key, 31, 0, 0).choose(key).name == first  # bound max(14, 32)
    assert loaded(key, 32, 0, 0).choose(key).name == second
    assert loaded(key, 100, 80, 80).choose(key).name == first  # bound max(109, 112)
    assert loaded(key, 120, 80, 80).choose(key).name == second  # bound max(118, 112)


def test_a_full_first_choice_gives_way_to_one_with_a_free_slot_and_none_waits_in_a_workers_stream():
    key = b"conversation"
    first, second = order_of(view(0, 0), key)
    assert loaded(key, 2, 1, slots=2).choose(key).name == second  # the first has no free slot, the second has one
    # Neither has a free slot: the job goes through the lanes, where lanes and shares hold.
    assert loaded(key, 2, 2, slots=2).choose(key) is None


def test_the_lanes_take_a_job_with_one_worker_or_none_under_the_bound():
    assert view(0).choose(b"k") is None
    assert View(0, []).choose(b"k") is None
    assert view(4, 4, slots=4).choose(b"k") is None  # each at its slots


def test_placement_counts_what_it_placed_and_counts_it_into_the_load():
    placement = Placement()
    v = placement.views["q"] = view(0, 0, slots=2)
    streams = drive(placement.streams_for(KEYS, "q", [b"a", b"a", b"a"]))
    first, second = (KEYS.own_queue("q", name) for name in order_of(v, b"a"))
    assert streams == [first, first, second]  # the first choice's two slots are taken by the first two
    assert sum(c.load for c in v.candidates) == 3
    assert placement.placed == {Placed.AFFINITY: 3, Placed.SHARED: 0}
    off = Placement(enabled=False)
    assert drive(off.streams_for(KEYS, "q", [b"a"])) == [None] and off.placed[Placed.SHARED] == 1


def drive(steps):
    """A steps operation that needs no round trip (the view is fresh): its value."""
    with pytest.raises(StopIteration) as done:
        next(steps)
    return done.value.value


def test_only_serving_lane_aware_workers_of_the_queue_that_advertise_placement_are_candidates():
    beat = {
        "name": "a",
        "queue": "q",
        "state": "serving",
        "placement": "1",
        "lanes": "1",
        "running": "3",
        "slots": "8",
        "placed_held": "2",
    }
    beats = [
        beat,
        {**beat, "name": "b", "state": "draining"},
        {**beat, "name": "c", "queue": "other"},
        {**beat, "name": "d", "placement": "0"},
        {},
        {**beat, "name": "e", "slots": "many"},
        {key: value for key, value in beat.items() if key != "lanes"},  # a worker that reads no lanes
    ]
    # a's load: 3 running, and 5 entries in its stream of which 2 are among those it holds.
    assert candidates_from(beats, [5, 0, 0, 0, 0, 0, 0], "q") == [Candidate("a", 8, 6)]


# -- the worker loop on a real redis-server ---------------------------------------------------------

FAST = dict(claim_idle_ms=500, reclaim_interval_s=0.05, heartbeat_ttl_s=2.0, block_ms=200, placement_poll_ms=20)


def enqueue_on(client: Client, owner: str, prompt: str, **options) -> str:
    """A job placed on `owner`'s stream, as a producer's placement would place it."""
    job = build_job(prompt, None, None, None, None, 0, {"max_tokens": 8, **options})
    stream = KEYS.own_queue(client.queue, owner)
    replies = execution.execute(
        client.redis,
        enqueue_commands(KEYS, client.queue, None, job, True, client.replication, stream),
    )
    assert is_entry_id(replies[1])  # a placed job's entry is a plain XADD's
    return job.job_id


class ThreeForms:
    """One conversation sent three ways, each turn the one before with its answer and the next user
    text: as `messages`, as a plain prompt and as token ids. The ids are Qwen3's single-byte tokens
    (its ids below 256, "\n" is 198): the echo worker's vocabulary is 256 ids, and a tokenization of
    the plain prompt in Qwen3's vocabulary is what a producer that keeps ids would send."""

    def __init__(self, opening: str, system: str):
        self.messages = [{"role": "system", "content": system}] if system else []
        self.messages.append({"role": "user", "content": opening})
        self.prompt = (f"{system}\n" if system else "") + f"User: {opening}\nAssistant:"
        self.input_ids = byte_ids(self.prompt)

    def requests(self) -> dict[str, dict]:
        return {
            "messages": {"messages": self.messages},
            "prompt": {"prompt": self.prompt},
            "ids": {"input_ids": self.input_ids},
        }

    def answered(self, answers: dict[str, JobResult], user: str) -> None:
        self.messages = [*self.messages, {"role": "assistant", "content": answers["messages"].text}]
        self.messages.append({"role": "user", "content": user})
        self.prompt += f"{answers['prompt'].text}\nUser: {user}\nAssistant:"
        self.input_ids = self.input_ids + answers["ids"].token_ids + byte_ids(f"\nUser: {user}\nAssistant:")

    def sizes(self) -> tuple[int, int]:
        return len(self.prompt), len(self.input_ids)


def byte_ids(text: str) -> list[int]:
    single_byte = qwen3_single_byte_ids()
    return [single_byte[b] for b in text.encode()]


@functools.cache
def qwen3_single_byte_ids() -> list[int]:
    """The id of each byte's token in Qwen3's vocabulary, loaded on first use (2 s), not at import."""
    ranks = load_qwen_ranks()
    return [ranks[bytes([b])] for b in range(256)]


# A pasted document: the conversation that carries it passes 1,024 characters and 256 ids at turn 2.
PASTE = " Here is the document: " + "lorem ipsum dolor sit amet " * 40


def test_each_conversation_runs_on_its_first_choice_turn_after_turn_whatever_its_form(redis_server, queue):
    """Six conversations, each sent as `messages`, as a growing plain prompt and as growing token
    ids, three turns each: with and without a system prompt, four short ones (every turn under
    1,024 characters and 256 ids) and two whose second turn pastes a document (over both). Each
    turn runs on the first choice of its conversation's first turn (turns 1, 2, 3 on one worker)."""
    # Fixed names, so the rendezvous order of the conversations is fixed too: with names drawn at
    # random (the queue's), all six of a form could choose one worker, one run in 243.
    names = [f"affinity-{i}" for i in range(3)]
    chats = {
        i: ThreeForms(f"conversation {i}: tell me about {i * 7}", "You are a helpful assistant." if i % 2 else "")
        for i in range(6)
    }
    first_keys = {
        (form, i): prefix_key(request(**fields)) for i, c in chats.items() for form, fields in c.requests().items()
    }
    sizes: dict[int, list[tuple[int, int]]] = {i: [] for i in chats}  # each turn's characters and ids
    ran_on: dict[tuple[str, int], set[str]] = {chat: set() for chat in first_keys}
    with ExitStack() as stack:
        workers = [stack.enter_context(serving(redis_server.url, queue, name=n, **FAST)) for n in names]
        client = stack.enter_context(Client(redis_server.url, queue))
        client.placement = Placement(refresh_s=0)  # a fresh view for every job: each sees all workers idle
        assert eventually(lambda: all(w.queue.redis.exists(KEYS.worker(w.name)) for w in workers))
        for turn in range(3):
            for i, chat in chats.items():
                sizes[i].append(chat.sizes())
                answers = {
                    form: client.generate(**fields, max_tokens=4, timeout=30)
                    for form, fields in chat.requests().items()
                }
                for form, result in answers.items():
                    ran_on[form, i].add(result.worker)
                chat.answered(answers, f"and then? ({turn})" + (PASTE if i >= 4 and turn == 0 else ""))
                time.sleep(0.12)  # two heartbeats: the workers' running counts are back to 0
        assert all(n < PREFIX_CHARS and m < PREFIX_IDS for i in range(4) for n, m in sizes[i])
        assert all(n < PREFIX_CHARS and m < PREFIX_IDS for n, m in (sizes[4][0], sizes[5][0]))
        assert all(n > PREFIX_CHARS and m > PREFIX_IDS for n, m in sizes[4][1:] + sizes[5][1:])
        assert ran_on == {chat: {first_choices(names, [key])[0]} for chat, key in first_keys.items()}
        assert client.placement.placed == {Placed.AFFINITY: 54, Placed.SHARED: 0}
        assert sum(w.metrics.taken["own"]._value.get() for w in workers) == 54
        for form in ("messages", "prompt", "ids"):
            assert len({w for (f, _), ws in ran_on.items() if f == form for w in ws}) >= 2


@on_modes("server", "cluster")
def test_entries_placed_on_a_stalled_worker_are_stolen_after_the_steal_delay(
    redis_deployment, deployment_client, queue
):
    url, redis_client = redis_deployment.url, deployment_client
    steal_delay_s = 0.3
    settings = dict(FAST, steal_delay_ms=int(steal_delay_s * 1000), claim_idle_ms=3000, engine={"max_running": 2})
    with ExitStack() as stack:
        stalled = stack.enter_context(serving(url, queue, name=f"{queue}-a", worker_class=GatedWorker, **settings))
        taker = stack.enter_context(serving(url, queue, name=f"{queue}-b", step_s=0.01, **settings))
        client = stack.enter_context(Client(url, queue))
        assert eventually(lambda: redis_client.exists(KEYS.worker(taker.name)))
        stalled.gate.clear()
        time.sleep(0.1)
        jobs = [enqueue_on(client, stalled.name, f"job {i} placed on a stalled worker") for i in range(8)]
        results = [client.result(job_id, timeout=30) for job_id in jobs]
        stalled.gate.set()
        assert {r.worker for r in results} == {taker.name}
        waits = sorted(r.timings.queue_s for r in results)
        assert waits[0] >= steal_delay_s  # none before its delay
        # The first two (the taker's slots) start within the delay, a scan interval (half the delay)
        # and a loop iteration; the rest wait for those slots, as they would on the shared stream.
        assert waits[1] <= 1.5 * steal_delay_s + 0.2
        assert taker.metrics.taken["stolen"]._value.get() == 8
        own = KEYS.own_queue(queue, stalled.name)
        assert eventually(lambda: redis_client.xlen(own) == 0 and redis_client.xpending(own, GROUP)["pending"] == 0)
        time.sleep(0.3)  # the stalled worker is back: it must not run them again
        for job_id in jobs:
            assert_one_final_result(redis_client, job_id)
        assert stalled.metrics.taken["own"]._value.get() == 0


@on_modes("server", "cluster")
def test_a_dead_workers_placed_jobs_are_reclaimed_and_resume_after_their_tokens(
    redis_deployment, deployment_client, queue
):
    url, redis_client = redis_deployment.url, deployment_client
    settings = dict(FAST, engine={"max_running": 4})
    prompt = "a job placed on a worker that dies while it runs it, long enough to be killed half-way"
    with ExitStack() as stack:
        victim = stack.enter_context(
            serving(
                url,
                queue,
                name=f"{queue}-a",
                worker_class=GatedWorker,
                step_s=0.02,
                checkpoint_interval_s=0.05,
                **settings,
            )
        )
        client = stack.enter_context(Client(url, queue))
        jobs = [enqueue_on(client, victim.name, f"{prompt} {i}", max_tokens=60) for i in range(3)]
        assert eventually(lambda: all(len(tokens_published(redis_client, j)) >= 5 for j in jobs))
        victim.killed = True
        victim.gate.clear()
        survivor = stack.enter_context(serving(url, queue, name=f"{queue}-b", step_s=0.005, **settings))
        results = [client.result(job_id, timeout=30) for job_id in jobs]
        assert {r.worker for r in results} == {survivor.name}
        for i, (job_id, result) in enumerate(zip(jobs, results)):
            assert result.token_ids == list(f"{prompt} {i}".encode()[:60])
            assert tokens_published(redis_client, job_id) == result.token_ids  # resumed: no token twice
            assert_one_final_result(redis_client, job_id)
        assert survivor.metrics.taken["reclaimed"]._value.get() == 3
        victim.gate.set()


@pytest.mark.parametrize("side", ["client", "worker"])
def test_placement_turned_off_on_either_side_leaves_every_job_on_the_shared_stream(redis_server, queue, side):
    worker_settings = dict(FAST, placement=side != "worker")
    with ExitStack() as stack:
        workers = [
            stack.enter_context(serving(redis_server.url, queue, name=f"{queue}-{i}", **worker_settings))
            for i in range(2)
        ]
        client = stack.enter_context(Client(redis_server.url, queue, placement=side != "client"))
        client.placement.refresh_s = 0
        assert eventually(lambda: all(w.queue.redis.exists(KEYS.worker(w.name)) for w in workers))
        time.sleep(0.1)
        for i in range(6):
            client.generate(f"job {i}", max_tokens=2, timeout=30)
        assert client.placement.placed == {Placed.AFFINITY: 0, Placed.SHARED: 6}
        assert sum(w.metrics.taken["shared"]._value.get() for w in workers) == 6


def test_submit_many_places_a_chunk_and_what_goes_in_is_still_a_prefix(redis_server, queue, redis_client):
    """Two workers of two slots each, as their heartbeats say (no worker runs: nothing is read).
    Six jobs of one prompt: two on the first choice, two on the second (free slots), one on the
    shared stream, and the sixth finds the shared stream full (max_queue_depth 1): BulkQueueFull
    names the five that went in."""
    for name in ("a", "b"):
        beat = {
            "name": name,
            "queue": queue,
            "state": "serving",
            "placement": 1,
            "lanes": 1,
            "slots": 2,
            "running": 0,
            "placed_held": 0,
        }
        redis_client.hset(KEYS.worker(name), mapping=beat)
        redis_client.zadd(KEYS.workers(queue), {name: time.time()})
    with Client(redis_server.url, queue, max_queue_depth=1) as client:
        with pytest.raises(BulkQueueFull) as full:
            client.submit_many(
                [{"prompt": "same prompt", "max_tokens": 1, "request_id": f"{queue}-{i}"} for i in range(6)]
            )
    ids = [f"{queue}-{i}" for i in range(6)]
    assert full.value.job_ids == ids[:5]
    on = {name: [f["id"] for _, f in redis_client.xrange(KEYS.own_queue(queue, name))] for name in ("a", "b")}
    shared = [f["id"] for _, f in redis_client.xrange(KEYS.queue(queue))]
    by_rank = sorted(
        ("a", "b"), key=lambda n: rendezvous_score(prefix_key(request(prompt="same prompt")), n), reverse=True
    )
    assert on[by_rank[0]] == [ids[0], ids[1]]
    assert on[by_rank[1]] == [ids[2], ids[3]]
    assert shared == [ids[4]]
    assert [bool(redis_client.exists(KEYS.job(job_id))) for job_id in ids] == [True] * 5 + [False]


def test_an_idle_worker_on_one_server_wakes_for_a_job_placed_on_it_at_once(redis_server, queue, redis_client):
    """Idle, the worker blocks on its own stream and the shared one in one read (one server): a job
    placed on it starts well within the block, however long that is (here 1.5 s, four jobs; the
    heartbeat, which also ends a block, every 2 s)."""
    settings = dict(
        FAST, block_ms=1500, placement_poll_ms=1500, heartbeat_interval_s=2.0, heartbeat_ttl_s=4.0, claim_idle_ms=5000
    )
    with ExitStack() as stack:
        worker = stack.enter_context(serving(redis_server.url, queue, name=f"{queue}-a", **settings))
        client = stack.enter_context(Client(redis_server.url, queue))
        assert eventually(lambda: redis_client.exists(KEYS.worker(worker.name)))
        waits = []
        for i in range(4):
            time.sleep(0.3)  # idle again: blocked in its read
            job_id = enqueue_on(client, worker.name, f"wake {i}")
            waits.append(client.result(job_id, timeout=30).timings.queue_s)
        assert max(waits) < 0.5, waits
        assert worker.metrics.taken["own"]._value.get() == 4


def test_a_placed_job_whose_workers_stream_is_of_another_type_goes_to_the_shared_stream(
    redis_server, queue, redis_client
):
    """A worker's own stream is under the producers' `mili:q:*`: one a producer made another type
    failed the XADD of the job placed there with a raw WRONGTYPE (the gateway's 503), and a view
    read meanwhile failed every submit of the queue, until that worker's READ made it anew. Now
    the job goes to the shared stream, where any worker takes it, and the view is read again: a
    worker whose stream is of another type is no candidate. Two workers, as their heartbeats say
    (no worker runs: the stream stays as planted); a view that never goes stale by itself."""
    beat_two_workers(redis_client, queue, slots=4)

    def shared() -> list[str]:
        return [f["id"] for _, f in redis_client.xrange(KEYS.queue(queue))]

    with Client(redis_server.url, queue) as client:
        client.placement.refresh_s = 3600
        first = client.submit("same prompt", max_tokens=1)
        [chosen] = [n for n in ("a", "b") if redis_client.xlen(KEYS.own_queue(queue, n))]
        redis_client.eval(
            "redis.call('DEL', KEYS[1]) return redis.call('HSET', KEYS[1], 'not', 'ours')",
            1,
            KEYS.own_queue(queue, chosen),
        )
        second = client.submit("same prompt", max_tokens=1)  # placed on `chosen` by the view it keeps
        assert shared() == [second]
        third = client.submit("same prompt", max_tokens=1)  # the view read again: one candidate left
        assert shared() == [second, third]
    with Client(redis_server.url, queue) as fresh:  # its first view meets the stream of another type
        fourth = fresh.submit("same prompt", max_tokens=1)
    assert shared() == [second, third, fourth]
    assert [redis_client.hget(KEYS.job(job), "status") for job in (first, second, third, fourth)] == ["queued"] * 4
    assert redis_client.type(KEYS.own_queue(queue, chosen)) == "hash"


def test_generate_placed_on_a_stream_of_another_type_goes_to_the_shared_stream_at_once(
    redis_server, queue, redis_client
):
    """generate() sends its first blocking read of the job's end in the enqueue's round trip, where
    nothing should refuse the enqueue: a placed XADD refused (WRONGTYPE) left that read waiting out
    its block (2 s) for a job never enqueued before the job went to the shared stream. The client
    now drops the connection rather than wait for the read (Redis ends a closed client's block). No
    worker runs: the job waits in the shared stream, found there within well under the block."""
    beat_two_workers(redis_client, queue, slots=4)
    with Client(redis_server.url, queue) as client:
        client.placement.refresh_s = 3600
        client.submit("same prompt", max_tokens=1)
        [chosen] = [n for n in ("a", "b") if redis_client.xlen(KEYS.own_queue(queue, n))]
        plant_hash(redis_client, KEYS.own_queue(queue, chosen))
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            waiting = pool.submit(client.generate, "same prompt", max_tokens=1, timeout=4 * MAX_BLOCK_MS / 1000)
            assert eventually(lambda: redis_client.xlen(KEYS.queue(queue)), timeout=10)
            took = time.monotonic() - started
            with pytest.raises(JobTimeout):
                waiting.result()
    assert took < MAX_BLOCK_MS / 1000 * 0.75, took
    assert redis_client.type(KEYS.own_queue(queue, chosen)) == "hash"


def test_submit_many_sends_its_jobs_placed_on_a_stream_of_another_type_to_the_shared_stream(
    redis_server, queue, redis_client
):
    """As submit's (above): on main submit_many raised the placed XADDs' raw WRONGTYPE and forgot
    the placed jobs. Two workers of four slots; a submit reads the view and places its job on the
    first choice, whose stream then becomes a hash: of six jobs of the same prompt, those placed
    there go to the shared stream, the others to the second choice's stream or the shared one."""
    beat_two_workers(redis_client, queue, slots=4)
    first, second = sorted(
        ("a", "b"), key=lambda n: rendezvous_score(prefix_key(request(prompt="same prompt")), n), reverse=True
    )
    with Client(redis_server.url, queue) as client:
        client.placement.refresh_s = 3600
        client.submit("same prompt", max_tokens=1)
        plant_hash(redis_client, KEYS.own_queue(queue, first))
        ids = client.submit_many([{"prompt": "same prompt", "max_tokens": 1} for _ in range(6)])
    on_second = [f["id"] for _, f in redis_client.xrange(KEYS.own_queue(queue, second))]
    shared = [f["id"] for _, f in redis_client.xrange(KEYS.queue(queue))]
    assert ids[0] in shared  # placed on the first choice, within its bound
    assert sorted(on_second + shared) == sorted(ids)
    assert [redis_client.hget(KEYS.job(job_id), "status") for job_id in ids] == ["queued"] * 6
    assert redis_client.type(KEYS.own_queue(queue, first)) == "hash"


@pytest.mark.parametrize("tiers", ["placed", "mixed"])
def test_submit_many_keeps_every_placed_job_that_went_in_when_the_shared_route_refuses_the_others(
    redis_server, queue, redis_client, tiers
):
    """A chunk placed on two workers of two slots each, as their heartbeats say, whose first choice's
    stream a producer made a hash: its jobs' XADDs fail (WRONGTYPE) and they go to the shared route,
    whose stream is a hash too, and refuses them. On main the clean-up after that refusal took the
    hashes of the jobs that went in on the second choice's stream too (their entries pointed at no
    hash: lost), and the error named none of them. Now the error (InvalidQueueStream) names exactly
    the jobs that went in, not a prefix: those on the second choice's stream and (`mixed`: a fifth
    job of the default lane, past the free slots) the one on the shared stream, of the default
    lane, whose refused jobs are of lane `priority`. Each keeps its hash and is served to its end
    by the second choice's worker once it runs; the refused left no key."""
    first, second = sorted(
        (f"{queue}-a", f"{queue}-b"),
        key=lambda n: rendezvous_score(prefix_key(request(prompt="same prompt")), n),
        reverse=True,
    )
    beat_two_workers(redis_client, queue, slots=2, names=(first, second))
    refused_lane = "priority" if tiers == "mixed" else "default"
    ids = [f"{queue}-{i}" for i in range(5 if tiers == "mixed" else 4)]
    jobs = [{"prompt": "same prompt", "max_tokens": 2, "request_id": job_id} for job_id in ids]
    for job in jobs[:2]:
        job["service_tier"] = refused_lane
    with Client(redis_server.url, queue) as client:
        client.placement.refresh_s = 3600
        steps.run(client.redis, client.placement.streams_for(KEYS, queue, []))  # the view it keeps
        plant_hash(redis_client, KEYS.own_queue(queue, first))
        plant_hash(redis_client, KEYS.lane_stream(queue, refused_lane, NO_TENANT))
        with pytest.raises(InvalidQueueStream) as refused:
            client.submit_many(jobs)
        went_in = ids[2:]
        assert refused.value.job_ids == went_in
        on_second = [f["id"] for _, f in redis_client.xrange(KEYS.own_queue(queue, second))]
        assert on_second == ids[2:4]
        if tiers == "mixed":
            assert [f["id"] for _, f in redis_client.xrange(KEYS.queue(queue))] == ids[4:]
        assert [redis_client.hget(KEYS.job(job_id), "status") for job_id in went_in] == ["queued"] * len(went_in)
        assert [redis_client.exists(KEYS.job(job_id), KEYS.done(job_id)) for job_id in ids[:2]] == [0, 0]
        redis_client.delete(KEYS.own_queue(queue, first), KEYS.lane_stream(queue, refused_lane, NO_TENANT))
        redis_client.zrem(KEYS.workers(queue), first)
        with serving(redis_server.url, queue, name=second, **FAST):
            results = [client.result(job_id, timeout=30) for job_id in went_in]
    assert [result.status for result in results] == ["done"] * len(went_in)


@pytest.mark.parametrize("refusal", list(WRITES_REFUSED))
def test_submit_many_whose_placed_xadds_redis_refuses_for_now_raises_the_typed_error_naming_the_jobs_in(
    queue, monkeypatch, refusal
):
    """Five jobs of one prompt on two workers of two slots each, as their heartbeats say: four placed
    (two on each), the fifth on the shared stream. Redis refuses writes (OOM, READONLY) once the
    lanes took theirs, before the placed XADDs, and takes them again for the clean-up. On main the
    XADDs' refusal was redis-py's raw OutOfMemoryError (ReadOnlyError), naming no job; now it is
    RedisOutOfMemory (RedisReadOnly), as a submit's, a kind of redis-py's class, whose job_ids are
    exactly the job in the queue: the fifth. It keeps its hash and entry; the four have neither."""
    kind, refuse, allow = WRITES_REFUSED[refusal]
    ids = [f"{queue}-{i}" for i in range(5)]
    placed = bulk.enqueue_placed_commands
    flags = bulk.flag_commands

    def refused_first(*args):
        refuse(admin)
        return placed(*args)

    def allowed_again(*args):
        allow(admin)
        return flags(*args)

    with EmbeddedRedis(port=free_port()) as server, redis.Redis.from_url(server.url, decode_responses=True) as admin:
        beat_two_workers(admin, queue, slots=2)
        with Client(server.url, queue) as client:
            client.placement.refresh_s = 3600
            steps.run(client.redis, client.placement.streams_for(KEYS, queue, []))  # the view it keeps
            monkeypatch.setattr(bulk, "enqueue_placed_commands", refused_first)
            monkeypatch.setattr(bulk, "flag_commands", allowed_again)
            with pytest.raises(kind) as stopped:
                client.submit_many([{"prompt": "same prompt", "max_tokens": 1, "request_id": i} for i in ids])
        assert isinstance(stopped.value, (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError))
        assert stopped.value.command.startswith("XADD on 'mili:q:{"), stopped.value.command
        assert stopped.value.job_ids == ids[4:]
        assert [f["id"] for _, f in admin.xrange(KEYS.queue(queue))] == ids[4:]
        assert [admin.exists(KEYS.own_queue(queue, name)) for name in ("a", "b")] == [0, 0]
        assert [admin.hget(KEYS.job(job_id), "status") for job_id in ids] == [None] * 4 + ["queued"]


def beat_two_workers(redis_client, queue: str, slots: int, names: tuple[str, str] = ("a", "b")) -> None:
    """Heartbeats of workers `names` of `queue`, serving with placement and lanes (no worker runs)."""
    for name in names:
        beat = {"name": name, "queue": queue, "state": "serving", "placement": 1, "lanes": 1}
        redis_client.hset(KEYS.worker(name), mapping={**beat, "slots": slots, "running": 0, "placed_held": 0})
        redis_client.zadd(KEYS.workers(queue), {name: time.time()})


def plant_hash(redis_client, key: str) -> None:
    """`key` made a hash in one script, as a producer may (tests/chaos/test_hostile_keys.py)."""
    redis_client.eval("redis.call('DEL', KEYS[1]) return redis.call('HSET', KEYS[1], 'not', 'ours')", 1, key)
