"""GET /v1/batches pages over an index that outlives the batches it names: a batch that expired
(its hash gone) leaves the index when a listing meets it, and a page never comes up short for it."""

import uuid

from gateway.batch.store import LOGGED_IDS, WarnedOnce
from producer_client.keys import Keys
from producer_client.protocol.batch import listed_batches
from producer_client.steps import run


def test_a_page_with_expired_batches_in_it_reads_on_to_a_full_page(redis_client):
    keys = Keys(prefix=f"list-{uuid.uuid4().hex[:8]}")
    ids = [f"batch_{i}" for i in range(8)]
    for i, batch_id in enumerate(ids):
        redis_client.zadd(keys.batches(), {batch_id: i})
        if i not in (5, 6, 3):  # these three expired: their hashes are gone
            redis_client.hset(keys.batch(batch_id), "id", batch_id)
    first = [b["id"] for b in run(redis_client, listed_batches(keys, None, 2, None)).found]
    assert first == ["batch_7", "batch_4", "batch_2"]  # limit + 1: has_more
    second = [b["id"] for b in run(redis_client, listed_batches(keys, "batch_4", 2, None)).found]
    assert second == ["batch_2", "batch_1", "batch_0"]
    last = [b["id"] for b in run(redis_client, listed_batches(keys, "batch_1", 2, None)).found]
    assert last == ["batch_0"]
    assert redis_client.zrevrange(keys.batches(), 0, -1) == ["batch_7", "batch_4", "batch_2", "batch_1", "batch_0"]


def test_the_ids_warned_about_once_are_bounded_and_the_oldest_forgotten():
    """The store's memory of keys of another type it warned about grew by every id anyone made
    such a key under, for the gateway's life; it keeps the last LOGGED_IDS."""
    warned = WarnedOnce(most=3)
    assert [warned.first_time(i) for i in ("a", "b", "c", "a")] == [True, True, True, False]
    assert warned.first_time("d")  # "b", the least recently met, is forgotten: "a" was met again
    assert list(warned.ids) == ["c", "a", "d"]
    assert warned.first_time("b") and not warned.first_time("d")
    many = WarnedOnce()
    for i in range(10 * LOGGED_IDS):
        many.first_time(f"batch_{i}")
    assert len(many.ids) == LOGGED_IDS
