"""The scheduler driven by a fake model that 'computes' chunks and samples token 7."""

import pytest

from producer_client.schema import SamplingParams
from worker.engine.kv_pool import PageAllocator
from worker.engine.radix_cache import RadixCache
from worker.engine.request import Request, RequestStatus
from worker.engine.scheduler import Scheduler, SchedulerOutput

PS = 4
MAX_MODEL_LEN = 4096


def make_scheduler(num_pages=64, max_running=8, budget=64, prefix_cache=True) -> Scheduler:
    alloc = PageAllocator(num_pages)
    return Scheduler(alloc, RadixCache(alloc, PS, prefix_cache), PS, max_running, budget, MAX_MODEL_LEN)


def add(
    sched: Scheduler, rid: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, base: int = 0, lane: int = 1
) -> Request:
    arrival = int(rid[1:])  # ids are r1, r2, ...: arrival order follows the number
    prompt = [base + i for i in range(prompt_len)]
    req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), priority, arrival, None, None, lane)
    sched.add(req)
    return req


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sampled = [c.request for c in out.chunks if c.samples]
    sched.commit(out.chunks)
    for req in sampled:
        req.token_ids.append(7)
        if req.num_output_tokens >= req.params.max_tokens:
            req.finish("length")
            sched.finish(req)
    return out


def run_all(sched: Scheduler, limit: int = 1000) -> int:
    steps = 0
    while sched.has_work():
        step(sched)
        steps += 1
        assert steps < limit, "no progress"
    return steps


def assert_pages_all_free_after_clear(sched: Scheduler) -> None:
    sched.cache.clear()
    assert sched.allocator.num_free == sched.allocator.num_pages
    assert sched.cache.evictable_pages == 0


def test_running_requests_decode_every_step_alongside_prefill_chunks():
    sched = make_scheduler(budget=16)
    a = add(sched, "r1", 3)
    step(sched)  # a's prefill
    b = add(sched, "r2", 40)
    out = step(sched)
    assert [(c.request, c.num_tokens, c.samples) for c in out.chunks] == [(a, 1, True), (b, 15, False)]
    out = step(sched)
    assert [(c.request, c.num_tokens) for c in out.chunks] == [(a, 1), (b, 15)]
    out = step(sched)
    assert [(c.request, c.num_tokens, c.samples) for c in out.chunks] == [(a, 1, True), (b, 10, True)]
    run_all(sched)
    assert_pages_all_free_after_clear(sched)


def test_max_running_caps_admission():
    sched = make_scheduler(max_running=2)
    reqs = [add(sched, f"r{i}", 5) for i in range(1, 5)]
    out = step(sched)
    assert [c.request for c in out.chunks] == reqs[:2]
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    run_all(sched)
    assert all(r.is_finished for r in reqs)


def test_lower_priority_number_is_admitted_first():
    sched = make_scheduler(max_running=1)
    late_urgent = add(sched, "r2", 5, priority=-1)
    early = add(sched, "r1", 5, priority=0)
    assert step(sched).chunks[0].request is late_urgent
    run_all(sched)
    assert early.is_finished


def test_page_shortage_preempts_the_newest_and_everything_completes():
    # 6 pages of 4 tokens: three 5-token prompts fit (2 pages each) until they decode past 8 tokens.
    sched = make_scheduler(num_pages=6, max_running=4)
    reqs = [add(sched, f"r{i}", 5, max_tokens=8, base=100 * i) for i in range(1, 4)]
    step(sched)
    assert all(r.status is RequestStatus.RUNNING for r in reqs)
    for _ in range(4):
        step(sched)  # the 4th decode writes position 8, which needs a third page each
    # r1 and r2 get theirs from r3's pages: r3 is preempted, and the page it had offered to the
    # prefix cache is evicted for r2.
    assert sched.num_preemptions == 1 and reqs[2].num_preemptions == 1
    assert [r.status for r in reqs] == [RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.WAITING]
    run_all(sched)
    assert all(r.num_output_tokens == 8 for r in reqs)
    assert_pages_all_free_after_clear(sched)


def test_a_higher_lane_request_preempts_a_lower_lanes_running_one_for_its_slot():
    sched = make_scheduler(max_running=2)
    flex = [add(sched, f"r{i}", 5, max_tokens=20, lane=2, base=100 * i) for i in (1, 2)]
    step(sched)
    default = add(sched, "r3", 5, lane=1, base=300)
    out = step(sched)
    # The newest flex request gives its slot up at once; the older one decodes on.
    assert (flex[1].status, default.status, flex[0].status) == (RequestStatus.WAITING,) + (RequestStatus.RUNNING,) * 2
    assert [c.request for c in out.chunks] == [flex[0], default]
    priority = add(sched, "r4", 5, lane=0, base=400)
    step(sched)
    assert flex[0].status is RequestStatus.WAITING and sched.num_preemptions == 2
    assert sched.running == [priority, default]
    run_all(sched)
    assert all(r.num_output_tokens == r.params.max_tokens for r in [*flex, default, priority])
    assert_pages_all_free_after_clear(sched)


def test_a_priority_prefill_runs_its_lane_alone_for_one_step_and_never_two_in_a_row():
    sched = make_scheduler(max_running=4)
    default = [add(sched, f"r{i}", 5, max_tokens=20, lane=1, base=100 * i) for i in (1, 2)]
    flex = add(sched, "r3", 5, max_tokens=20, lane=2, base=300)
    step(sched)  # their prefills
    first = add(sched, "r4", 6, lane=0, base=400)
    out = step(sched)
    # The first priority request's prefill: a step of its own; nobody preempted (a slot was free).
    assert [(c.request, c.num_tokens) for c in out.chunks] == [(first, 6)]
    assert sched.num_preemptions == 0 and len(sched.running) == 4
    second = add(sched, "r5", 6, lane=0, base=500)
    out = step(sched)
    # The next step runs every lane: the others' decodes, and the second prefill, which preempts the
    # flex request for its slot.
    assert [(c.request, c.num_tokens) for c in out.chunks] == [(first, 1), *((d, 1) for d in default), (second, 6)]
    assert flex.status is RequestStatus.WAITING and sched.num_preemptions == 1
    out = step(sched)  # no priority prefill left: every running request decodes
    assert [c.request for c in out.chunks] == [first, second, *default]
    run_all(sched)
    assert all(r.num_output_tokens == r.params.max_tokens for r in [*default, flex, first, second])
    assert_pages_all_free_after_clear(sched)


def test_a_priority_prompt_in_chunks_runs_alone_every_other_step():
    sched = make_scheduler(max_running=4, budget=8)
    default = add(sched, "r1", 5, max_tokens=20, lane=1)
    step(sched)
    priority = add(sched, "r2", 30, max_tokens=2, lane=0, base=200)
    chunks = [[(c.request, c.num_tokens) for c in step(sched).chunks] for _ in range(5)]
    # 30 tokens in chunks under a budget of 8: alone, then beside the default decode (7 left for it).
    assert chunks == [
        [(priority, 8)],
        [(default, 1), (priority, 7)],
        [(priority, 8)],
        [(default, 1), (priority, 7)],
        [(priority, 1), (default, 1)],
    ]
    run_all(sched)
    assert priority.num_output_tokens == 2 and default.num_output_tokens == 20


def test_within_a_lane_a_request_waits_for_a_slot():
    sched = make_scheduler(max_running=2)
    running = [add(sched, f"r{i}", 5, max_tokens=8, lane=1, priority=5, base=100 * i) for i in (1, 2)]
    step(sched)
    urgent = add(sched, "r3", 5, lane=1, priority=0, base=300)  # more urgent, same lane
    step(sched)
    assert urgent.status is RequestStatus.WAITING and sched.num_preemptions == 0
    assert all(r.status is RequestStatus.RUNNING for r in running)


def test_a_higher_lane_request_preempts_lower_lanes_for_pages():
    # 6 pages of 4 tokens: two flex requests of 9 tokens hold 3 each; a default one needs 2.
    sched = make_scheduler(num_pages=6, max_running=4, prefix_cache=False)
    flex = [add(sched, f"r{i}", 9, max_tokens=2, lane=2, base=100 * i) for i in (1, 2)]
    step(sched)
    default = add(sched, "r3", 5, max_tokens=2, lane=1, base=300)
    step(sched)
    assert default.status is RequestStatus.RUNNING and flex[1].status is RequestStatus.WAITING
    run_all(sched)
    assert all(r.num_output_tokens == 2 for r in [*flex, default])


def test_request_larger_than_the_pool_fails_and_the_rest_run():
    sched = make_scheduler(num_pages=4)
    small = add(sched, "r1", 3)
    huge = add(sched, "r2", 17)  # 5 pages > 4
    after = add(sched, "r3", 3)
    out = step(sched)
    assert out.failed == [huge]
    assert huge.finish_reason == "error" and huge.error.code == "kv_capacity_exceeded"
    assert "needs 5 KV pages for its 17 tokens; the whole pool holds 4 pages" in huge.error.message
    run_all(sched)
    assert small.num_output_tokens == after.num_output_tokens == 4
    assert_pages_all_free_after_clear(sched)


def test_request_that_outgrows_the_pool_alone_fails_instead_of_looping():
    sched = make_scheduler(num_pages=2)
    req = add(sched, "r1", 6, max_tokens=10)  # fits 2 pages at first, needs a third at 9 tokens
    failed = []
    while sched.has_work():
        failed += step(sched).failed
    assert failed == [req] and req.error.code == "kv_capacity_exceeded"
    assert req.num_output_tokens == 3  # 9 tokens: the token that no longer fits had just been sampled
    assert_pages_all_free_after_clear(sched)


def test_shared_prefix_is_matched_at_admission_and_counted():
    sched = make_scheduler()
    first = add(sched, "r1", 12)
    run_all(sched)
    second = add(sched, "r2", 14)  # same first 12 tokens (base 0)
    out = step(sched)
    assert out.chunks[0].request is second and out.chunks[0].num_tokens == 2
    assert second.num_cached_prompt_tokens == 12
    assert (sched.cache.queried_tokens, sched.cache.hit_tokens) == (26, 12)
    run_all(sched)
    assert first.is_finished and second.is_finished


def test_full_prompt_hit_still_runs_the_last_token():
    sched = make_scheduler()
    add(sched, "r1", 8)
    run_all(sched)
    again = add(sched, "r2", 8)
    out = step(sched)
    assert again.num_cached_prompt_tokens == 4  # the page holding the last prompt token is recomputed
    assert out.chunks[0].num_tokens == 4 and out.chunks[0].samples


def test_abort_returns_pages_of_running_and_waiting_requests():
    sched = make_scheduler(max_running=1)
    a = add(sched, "r1", 9, max_tokens=100)
    b = add(sched, "r2", 9)
    step(sched)
    assert sched.allocator.num_used == 3
    assert sched.abort("r1") is a and sched.abort("r2") is b
    assert sched.abort("r1") is None
    assert not sched.has_work()
    assert_pages_all_free_after_clear(sched)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_random_load_on_a_tight_pool_never_deadlocks_or_leaks(prefix_cache):
    import random

    rng = random.Random(0)
    sched = make_scheduler(num_pages=12, max_running=6, budget=10, prefix_cache=prefix_cache)
    reqs = [
        add(sched, f"r{i}", rng.randint(1, 30), max_tokens=rng.randint(1, 12), base=rng.choice([0, 50]))
        for i in range(1, 30)
    ]
    run_all(sched, limit=5000)
    assert all(r.num_output_tokens == r.params.max_tokens for r in reqs)
    assert_pages_all_free_after_clear(sched)
