"""Holdings, the one writer of a held job's state (worker/loop/holdings.py): its verbs refuse the
changes the protocol never makes (a run ended twice, a job started while a run of it is held, an
entry or a failure settled that nothing held), and settle each entry once: a written result
acknowledges its entry, a dead-lettered job's entry goes to the dead-letter stream."""

from collections import Counter

import pytest

from producer_client.keys import LANES, PROTOCOL_VERSION
from producer_client.schema import JobRequest
from worker.loop.holdings import Holdings
from worker.loop.intake import Delivery
from worker.loop.jobs import AdmissionId, Job, final_result
from worker.loop.outbox import HeldStateError, Rejection
from worker.loop.streams import Route


class Engine:
    """What Holdings asks of an engine: to abort a request."""

    def __init__(self):
        self.aborted = []

    def abort(self, request_id) -> bool:
        self.aborted.append(request_id)
        return True


def job(job_id: str = "j1", run: str = "r1", entry_id: str = "1-0") -> Job:
    request = JobRequest.model_validate({"prompt": "hi"})
    made = Job(job_id, entry_id, run, request, [1, 2], queued_at=0.0, started_at=0.0)
    made.engine_id = AdmissionId(job_id, 0)
    return made


def result(job_id: str = "j1"):
    return final_result(job_id, "done", "stop", "w1", 1.0, 0.0)


def delivery(entry_id: str = "1-0", job_id: str = "j1") -> Delivery:
    return Delivery(entry_id, {"id": job_id, "v": str(PROTOCOL_VERSION), "body": "{}"})


def test_a_run_ends_once_and_its_written_result_acknowledges_its_entry():
    holdings = Holdings(Engine())
    running = job()
    holdings.start(running, start_event="{}")
    holdings.finished(running, result())
    with pytest.raises(HeldStateError, match="run r1 ended twice"):
        holdings.end(running, result())
    [update] = holdings.send_updates()
    assert update.final == result() and update.start == "{}"
    with pytest.raises(HeldStateError, match="waits for Redis"):
        holdings.written(update)  # its entry cannot be settled before Redis answered
    assert holdings.answered(update)
    holdings.written(update)
    assert holdings.receipts() == (["1-0"], [])
    assert holdings.entries() == {}
    holdings.receipts_sent()
    assert holdings.receipts() == ([], []) and not holdings.unsettled()


def test_a_job_is_not_started_while_a_run_of_it_is_held():
    holdings = Holdings(Engine())
    holdings.start(job(run="r1"))
    with pytest.raises(HeldStateError, match="run r2 started while a run of it is held"):
        holdings.start(job(run="r2"))
    holdings.drop("j1")
    holdings.start(job(run="r2"))
    assert holdings.runs() == {"j1": "r2"}


def test_ending_a_running_job_takes_it_out_of_the_engine_and_a_finished_one_is_not_aborted():
    engine = Engine()
    holdings = Holdings(engine)
    ended, finished = job("a"), job("b", entry_id="2-0")
    holdings.start(ended)
    holdings.start(finished)
    holdings.end(ended, result("a"))
    holdings.finished(finished, result("b"))
    assert engine.aborted == [AdmissionId("a", 0)]
    assert holdings.running == {} and holdings.ended() == 2
    with pytest.raises(HeldStateError, match="without running there"):
        holdings.finished(finished, result("b"))


def test_an_entry_settles_once_and_only_after_its_claim_was_answered():
    holdings = Holdings(Engine())
    duplicate, poison = delivery("1-0", "j1"), delivery("2-0", "j2")
    holdings.take([duplicate, poison])
    with pytest.raises(HeldStateError, match="entry 1-0 of job j1"):
        holdings.ack_duplicate(duplicate)  # not claimed yet
    holdings.claims_answered()
    assert holdings.unadmitted == ()
    holdings.ack_duplicate(duplicate)
    with pytest.raises(HeldStateError, match="or twice"):
        holdings.ack_duplicate(duplicate)
    holdings.dead_letter(poison, "r2", 0, result("j2"), "delivered 4 times")
    [update] = holdings.send_updates()
    assert holdings.answered(update)
    holdings.written(update)
    acks, [letter] = holdings.receipts()
    assert (acks, letter.entry_id, letter.reason, letter.deliveries) == (["1-0"], "2-0", "delivered 4 times", 1)


def test_a_failure_is_settled_once_and_only_while_held():
    holdings = Holdings(Engine())
    failed = final_result("j1", "failed", "error", "w1", 1.0, 0.0)
    rejection = Rejection(failed, "1-0", {"id": "j1"})
    with pytest.raises(HeldStateError, match="not held"):
        holdings.failure_written(rejection)
    holdings.reject(rejection)
    assert holdings.entries() == {"1-0": "j1"}
    holdings.failure_written(rejection)
    with pytest.raises(HeldStateError, match="not held"):
        holdings.failure_refused(rejection, "and FAIL too")
    assert holdings.receipts() == (["1-0"], []) and holdings.rejected == ()


def test_the_check_before_a_step_agrees_with_the_unpublished_count_and_sums_the_jobs_only_near_its_limit():
    holdings = Holdings(Engine())
    running = job()
    holdings.start(running, start_event="{}")
    counts = []
    count = holdings.unpublished_tokens

    def counted() -> int:
        counts.append(count())
        return counts[-1]

    holdings.unpublished_tokens = counted  # type: ignore[method-assign]

    def agrees() -> None:
        for limit in range(1, 8):  # max_buffered_tokens is at least 1
            assert holdings.unpublished_reach(limit) == (count() >= limit), limit

    running.token_ids += [7, 8, 9, 10]  # a step's tokens, as the collector adds them
    holdings.collected(4)
    assert not holdings.unpublished_reach(5) and counts == []  # below the bound: no sum
    agrees()
    holdings.take_output(running)
    [update] = holdings.send_updates()
    agrees()
    assert holdings.answered(update)
    agrees()  # counted while the update is neither out nor waiting
    holdings.restore(update)  # Redis did not take it: its tokens wait again
    agrees()
    [update] = holdings.send_updates()
    assert holdings.answered(update)  # Redis took them
    agrees()
    assert count() == 0
    holdings.republish_whole(running.id, "r2", "{}")  # Redis lost them: the whole output again
    agrees()
    assert count() == 4 and len(counts) > 10


def lane_job(job_id: str, lane: str, timeout_s: float | None = None) -> Job:
    request = JobRequest.model_validate({"prompt": "hi", "timeout_s": timeout_s})
    made = Job(job_id, f"{job_id}-0", "r1", request, [1, 2], queued_at=0.0, started_at=0.0, route=Route(lane))
    made.engine_id = AdmissionId(job_id, 0)
    return made


def test_the_running_jobs_lanes_and_deadlines_are_kept_as_every_verb_starts_or_lets_go_of_a_job():
    """What the loop asks before every step (Admission.rooms: the running jobs of each lane;
    Worker._stop_overdue: those with a deadline) agrees with a count over the running jobs after
    each verb that starts a job or takes it out of the engine, a suspect's return included."""
    holdings = Holdings(Engine())

    def agree() -> None:
        counted = Counter(job.route.lane for job in holdings.running.values())
        assert {lane: n for lane, n in holdings.running_lanes.items() if n} == counted
        assert dict(holdings.timed) == {j.id: j for j in holdings.running.values() if j.deadline is not None}

    jobs = [lane_job(f"j{i}", LANES[i % 3], 30.0 if i % 2 else None) for i in range(9)]
    for made in jobs:
        holdings.start(made)
        agree()
    holdings.finished(jobs[0], result("j0"))
    agree()
    holdings.end(jobs[1], result("j1"))
    agree()
    holdings.suspect(jobs[3])
    agree()
    assert holdings.next_suspect() is jobs[3]
    holdings.start(jobs[3])  # tried again alone
    agree()
    holdings.drop("j5")
    holdings.drop("j-none")
    agree()
    with pytest.raises(HeldStateError):
        holdings.suspect(lane_job("j0", "default"))  # not running
    agree()
    assert sorted(holdings.timed) == ["j3", "j7"]
    assert dict(holdings.running_lanes) == {"priority": 2, "default": 2, "flex": 2}
