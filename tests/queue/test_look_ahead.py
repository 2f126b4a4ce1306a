"""A full worker's look for priority jobs sent ahead of its answer (producer_client/protocol/
look_ahead.py), on a real redis-server: it answers as the lanes stood when it was sent, one look
is out at a time, and a look whose connection broke gives no answer and lets the connection go,
the next one taking another."""

from __future__ import annotations

import redis

from producer_client.keys import LANES, Keys
from producer_client.protocol.look_ahead import LookAhead
from worker.loop.queue import connect

KEYS = Keys()


def test_a_look_sent_ahead_answers_as_the_priority_lanes_stood_when_it_was_sent(redis_server, redis_client, queue):
    lanes = [KEYS.lane(queue, LANES[0]), KEYS.lane(f"{queue}-2", LANES[0])]
    client = connect(redis_server.url)
    look = LookAhead(client, lanes)
    try:
        assert look.answer() is None  # none out
        look.send()
        redis_client.zadd(lanes[1], {"tenant": 1})  # after the send: not seen
        assert look.answer() is False
        look.send()
        look.send()  # one look out at a time: the second waits for the first's answer
        redis_client.delete(lanes[1])
        assert look.answer() is True
        assert look.answer() is None
        look.send()
        assert look.answer() is False
    finally:
        look.close()
        client.close()


def test_a_look_that_failed_gives_no_answer_and_the_next_takes_a_new_connection(restartable_redis, queue):
    """Refused (an ACL that forbids EXISTS), then sent while Redis is down: no answer either time,
    the connection let go; once Redis is back the next look answers."""
    lane = KEYS.lane(queue, LANES[0])
    client = connect(restartable_redis.url)
    admin = redis.Redis.from_url(restartable_redis.url)
    look = LookAhead(client, [lane])
    try:
        admin.acl_setuser("default", enabled=True, nopass=True, commands=["+@all", "-exists"], keys=["*"])
        look.send()
        refused = look.connection
        assert look.answer() is None
        assert (look.connection, refused._sock) == (None, None)  # disconnected: nothing left unread on it
        admin.acl_setuser("default", enabled=True, nopass=True, commands=["+@all"], keys=["*"])
        restartable_redis.stop()
        look.send()
        assert (look.connection, look.answer()) == (None, None)
        restartable_redis.start()
        admin.zadd(lane, {"tenant": 1})
        look.send()
        assert look.answer() is True
    finally:
        look.close()
        admin.close()
        client.close()
