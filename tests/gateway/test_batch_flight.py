"""The lines in flight of a batch run (openai_format/batch_flight.py), which `mili batch` and the
gateway's Batch API both run: what a line weighs against the limit and when it stops weighing,
lines due by queue, the lines a full queue refused waiting, and lines taken over from an
earlier run."""

import json
import time

import pytest

from openai_format import batch_flight
from openai_format.batch_flight import Flight
from openai_format.batch_lines import LineJobs, line_request, parse_line
from producer_client import BulkQueueFull, JobResult
from producer_client.keys import Keys
from producer_client.schema import Usage

# A full queue's refused lines wait out QUEUE_FULL_WAIT_S, four times: 0.1 s of CPU over its 0.8 s alone:
# tests/support/tiers.py's `waits`.
pytestmark = pytest.mark.waits


def line_jobs(custom_id: str, n: int = 1, queue: str | None = None) -> LineJobs:
    text = json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": "x", "n": n},
        }
    )
    return LineJobs(line_request(parse_line(text, 1), 1), f"rid-{custom_id}", queue)


def done(job_id: str) -> JobResult:
    return JobResult(id=job_id, status="done", text="ok", finish_reason="stop", usage=Usage())


def jobs(line: LineJobs) -> int:
    return len(line.request.specs)


def test_a_line_weighs_against_the_limit_from_its_adding_to_its_answer():
    flight = Flight(Keys(), limit=3, weight=jobs)
    two, three = line_jobs("two", n=2), line_jobs("three", n=3)
    assert flight.room() == 3
    flight.add(two)
    assert flight.room() == 1
    flight.add(three)
    assert flight.room() == 0
    assert flight.due() == {None: [two, three]} and flight.due() == {}
    flight.submitted([two, three])
    assert sorted(flight.jobs_out()) == sorted(two.job_ids + three.job_ids) and len(flight.watch) == 5
    assert flight.ended([done(two.job_ids[1])]) == [] and flight.room() == 0  # half a line answers nothing
    assert flight.ended([done(two.job_ids[0]), done(three.job_ids[0])]) == [two]
    assert flight.room() == 0 and not flight.idle  # 3 of `three` still weigh
    assert flight.ended([done(job_id) for job_id in three.job_ids[1:]]) == [three]
    assert flight.room() == 3 and flight.idle


def test_lines_are_due_by_queue_each_queues_in_their_order():
    flight = Flight(Keys(), limit=10, weight=lambda line: 1)
    a1, b1, a2 = line_jobs("a1", queue="a"), line_jobs("b1", queue="b"), line_jobs("a2", queue="a")
    for line in (a1, b1, a2):
        flight.add(line)
    assert flight.due() == {"a": [a1, a2], "b": [b1]}


def test_the_lines_a_full_queue_refused_wait_and_no_line_is_added_meanwhile(monkeypatch):
    monkeypatch.setattr(batch_flight, "QUEUE_FULL_WAIT_S", 0.05)
    flight = Flight(Keys(), limit=10, weight=jobs)
    lines = [line_jobs(f"c{i}", n=2) for i in range(3)]
    for line in lines:
        flight.add(line)
    # The queue took line 0 whole and half of line 1: line 1 waits whole, with line 2.
    full = BulkQueueFull("q", 3, 3, lines[0].job_ids + lines[1].job_ids[:1])
    assert flight.submitted(flight.due()[None], full) == lines[1:]
    assert flight.jobs_out() == lines[0].job_ids
    for _ in range(3):  # refused again and again: the wait starts anew each time
        assert flight.room() == 0 and flight.due() == {}
        time.sleep(0.2)
        assert flight.room() == 10 - 6
        due = flight.due()
        assert due == {None: lines[1:]}
        flight.submitted(due[None], BulkQueueFull("q", 3, 3, []))
    time.sleep(0.2)
    flight.submitted(flight.due()[None])
    assert flight.jobs_out() == [job_id for line in lines for job_id in line.job_ids] and not flight.waiting


def test_lines_taken_over_from_an_earlier_run_are_watched_and_weigh_but_are_not_due():
    flight = Flight(Keys(), limit=2, weight=lambda line: 1)
    earlier = [line_jobs("e0"), line_jobs("e1", n=2)]
    flight.resumed(earlier)
    assert flight.due() == {} and flight.room() == 0 and len(flight.watch) == 3
    assert flight.ended([done(earlier[0].job_ids[0])]) == earlier[:1] and flight.room() == 1


def test_a_line_whose_jobs_bytes_do_not_fit_waits_and_one_goes_alone_into_an_empty_flight():
    small, large = line_jobs("small"), line_jobs("large", n=3)
    flight = Flight(Keys(), limit=10, weight=lambda line: 1, max_bytes=small.request.jobs_bytes * 2)
    assert large.request.jobs_bytes == 3 * small.request.jobs_bytes
    assert flight.fits(large)  # the flight is empty: it goes alone
    flight.add(small)
    assert not flight.fits(large) and flight.fits(small) and flight.room() == 9
    flight.add(line_jobs("small2"))
    assert flight.bytes == flight.max_bytes and not flight.fits(line_jobs("small3"))
    flight.submitted(flight.due()[None])
    flight.ended([done(job_id) for job_id in flight.jobs_out()])
    assert flight.bytes == 0 and flight.fits(large)
    flight.add(large)
    assert not flight.fits(line_jobs("small3"))  # the large line alone, over the bound
