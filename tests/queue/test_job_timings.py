"""A result's timings on one clock: the worker's times are Redis's clock as the worker estimates
it, queued_at is Redis's own; a job started at once never reads as started before it was queued."""

import logging

from worker.loop.jobs import final_result
from worker.loop.publication import log_end

QUEUED_AT = 1_790_000_000.123


def test_no_time_of_a_result_precedes_the_one_before_it():
    early = QUEUED_AT - 0.001  # the worker's estimate of Redis's clock, half a round trip behind
    result = final_result("j1", "done", "stop", "w1", early, QUEUED_AT, started_at=early, first_token_at=early)
    t = result.timings
    assert (t.queued_at, t.started_at, t.first_token_at, t.finished_at) == (QUEUED_AT,) * 4
    assert (t.queue_s, t.ttft_s, t.e2e_s) == (0.0, 0.0, 0.0)


def test_times_in_order_are_kept_as_they_are():
    t = final_result(
        "j1", "done", "stop", "w1", QUEUED_AT + 3, QUEUED_AT, started_at=QUEUED_AT + 1, first_token_at=QUEUED_AT + 2
    ).timings
    assert (t.started_at, t.first_token_at, t.finished_at) == (QUEUED_AT + 1, QUEUED_AT + 2, QUEUED_AT + 3)


def test_a_job_failed_unread_finishes_no_earlier_than_it_was_queued():
    t = final_result("j1", "failed", "error", "w1", QUEUED_AT - 0.002, QUEUED_AT).timings
    assert (t.started_at, t.finished_at, t.e2e_s) == (None, QUEUED_AT, 0.0)


def test_the_end_line_of_a_job_started_at_once_says_queue_0_000s(caplog):
    early = QUEUED_AT - 0.001
    result = final_result("j1", "done", "stop", "w1", early, QUEUED_AT, started_at=early, first_token_at=early)
    with caplog.at_level(logging.INFO, logger="worker.loop.publication"):
        log_end(result)
    assert "queue 0.000s ttft 0.000s e2e 0.000s" in caplog.messages[0], caplog.messages


def test_a_rounds_ended_jobs_count_once_each_in_the_job_and_latency_metrics():
    from producer_client.schema import Usage
    from worker.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    done = [
        final_result(
            f"d{i}", "done", "stop", "w1", QUEUED_AT + 3, QUEUED_AT, usage=Usage(prompt_tokens=5, completion_tokens=3)
        )
        for i in range(3)
    ]
    failed = final_result("f1", "failed", "error", "w1", QUEUED_AT + 1, QUEUED_AT, usage=Usage(prompt_tokens=7))
    metrics.jobs_ended([done[0], failed, done[1]])
    metrics.job_ended(done[2])
    sample = metrics.registry.get_sample_value
    assert sample("mili_jobs_total", {"outcome": "done"}) == 3
    assert sample("mili_jobs_total", {"outcome": "failed"}) == 1
    assert sample("mili_prompt_tokens_total") == 15  # the done jobs' only
    assert sample("mili_e2e_request_latency_seconds_count") == 3
    assert sample("mili_e2e_request_latency_seconds_sum") == 9.0
