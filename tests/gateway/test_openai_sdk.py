"""The official `openai` SDK against the gateway, over a real worker on the `tiny` preset: what
comes back through HTTP is the worker's own result for the same job."""

import pytest

from producer_client import Client
from tests.gateway.support import TINY_QUEUE

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]


@pytest.fixture
def queue_client(redis_server):
    client = Client(redis_server.url, TINY_QUEUE)
    yield client
    client.close()


def job_ids(raw) -> list[str]:
    return raw.headers["x-mili-job-ids"].split(",")


def token_ids(logprobs) -> list[int]:
    return [int(t.token.removeprefix("token_id:")) for t in logprobs]


def test_chat_completion_is_the_workers_result_for_its_job(sdk, queue_client):
    raw = sdk.chat.completions.with_raw_response.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    answer = raw.parse()
    (job_id,) = job_ids(raw)
    result = queue_client.result(job_id, timeout=10)
    assert answer.object == "chat.completion" and answer.model == "tiny"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == result.text
    assert answer.choices[0].finish_reason == result.finish_reason
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
        result.usage.prompt_tokens,
        result.usage.completion_tokens,
    )
    assert answer.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    assert raw.headers["x-request-id"] == answer._request_id


def test_streamed_chat_deltas_add_up_to_the_workers_result(sdk, queue_client):
    with sdk.chat.completions.with_streaming_response.create(
        model="tiny",
        messages=CHAT,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ) as raw:
        (job_id,) = job_ids(raw)
        chunks = list(raw.parse())
    result = queue_client.result(job_id, timeout=10)
    choice_chunks = [c for c in chunks if c.choices]
    assert choice_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in choice_chunks) == result.text
    assert [c.choices[0].finish_reason for c in choice_chunks if c.choices[0].finish_reason] == [result.finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    assert (chunks[-1].choices, chunks[-1].usage.completion_tokens) == ([], result.usage.completion_tokens)
    assert len({c.id for c in chunks}) == 1


async def test_async_chat_and_text_completions_streamed_and_not(async_sdk, queue_client):
    whole = await async_sdk.completions.create(model="tiny", prompt="Redis streams are", max_tokens=10, temperature=0)
    stream = await async_sdk.completions.create(
        model="tiny",
        prompt="Redis streams are",
        max_tokens=10,
        temperature=0,
        stream=True,
    )
    streamed = [c async for c in stream]
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 10
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text  # greedy: the same tokens
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"

    chat = await async_sdk.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=8, temperature=0)
    chat_stream = await async_sdk.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=8, temperature=0, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in chat_stream])
    assert chat.usage.completion_tokens == 8
    assert text == chat.choices[0].message.content


def test_n_2_runs_two_jobs_and_returns_both_choices(sdk, queue_client):
    raw = sdk.chat.completions.with_raw_response.create(model="tiny", messages=CHAT, max_tokens=12, n=2, seed=11)
    answer = raw.parse()
    ids = job_ids(raw)
    results = [queue_client.result(job_id, timeout=10) for job_id in ids]
    assert len(set(ids)) == 2
    assert [c.index for c in answer.choices] == [0, 1]
    assert [c.message.content for c in answer.choices] == [r.text for r in results]
    assert answer.usage.completion_tokens == sum(r.usage.completion_tokens for r in results)
    assert answer.usage.prompt_tokens == results[0].usage.prompt_tokens  # one prompt, counted once


def test_a_seed_reproduces_the_same_choices(sdk):
    def sample(seed: int) -> list[str]:
        answer = sdk.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=seed, n=2
        )
        return [c.text for c in answer.choices]

    first = sample(seed=1234)
    assert sample(seed=1234) == first
    assert first[0] != first[1]  # choice i samples with seed + i
    assert sample(seed=99) != first


def test_a_stop_string_ends_the_text_before_it(sdk):
    def complete(**kwargs):
        return sdk.completions.create(model="tiny", prompt="The capital of France is", temperature=0, **kwargs).choices[
            0
        ]

    free = complete(max_tokens=24, extra_body={"ignore_eos": True})
    stop = free.text[len(free.text) // 2 :][:3]
    stopped = complete(max_tokens=24, stop=[stop], extra_body={"ignore_eos": True})
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    assert complete(max_tokens=24, stop=stop, extra_body={"ignore_eos": True}).text == stopped.text  # a plain string


def test_chat_logprobs_are_the_jobs_tokens_with_their_top_alternatives(sdk, queue_client):
    raw = sdk.chat.completions.with_raw_response.create(
        model="tiny",
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = raw.parse().choices[0].logprobs.content
    result = queue_client.result(job_ids(raw)[0], timeout=10)
    assert token_ids(content) == result.token_ids
    assert [t.logprob for t in content] == [lp.logprob for lp in result.logprobs]
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)
    assert [[top.token for top in t.top_logprobs] for t in content] == [
        [f"token_id:{i}" for i, _ in lp.top] for lp in result.logprobs
    ]


def test_streamed_completion_logprobs_cover_every_token_once(sdk, queue_client):
    with sdk.completions.with_streaming_response.create(
        model="tiny",
        prompt="Hello",
        max_tokens=8,
        temperature=0,
        logprobs=2,
        stream=True,
    ) as raw:
        job_id = job_ids(raw)[0]
        chunks = [c for c in raw.parse() if c.choices and c.choices[0].logprobs]
    result = queue_client.result(job_id, timeout=10)
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    tops = [top for c in chunks for top in c.choices[0].logprobs.top_logprobs]
    assert tokens == [f"token_id:{i}" for i in result.token_ids]
    assert [len(top) for top in tops] == [2] * len(result.token_ids)


def test_completion_prompts_as_strings_and_token_ids(sdk):
    ids = sdk.completions.create(model="tiny", prompt=[9707, 1879], max_tokens=4, temperature=0)
    many = sdk.completions.create(model="tiny", prompt=[[9707, 1879], [9707]], max_tokens=4, temperature=0, n=2)
    texts = sdk.completions.create(model="tiny", prompt=["Hello", "Bye"], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 2
    assert [c.index for c in many.choices] == [0, 1, 2, 3]  # prompt 0's two choices, then prompt 1's
    assert many.choices[0].text == many.choices[1].text == ids.choices[0].text  # greedy
    assert many.usage.prompt_tokens == 2 + 1  # each prompt once, not once per choice
    assert [c.index for c in texts.choices] == [0, 1] and texts.usage.completion_tokens == 8


def test_models_lists_what_live_workers_serve(sdk):
    names = {m.id for m in sdk.models.list()}
    assert {"tiny", "echo"} <= names
    assert sdk.models.retrieve("tiny").owned_by == "mili"
