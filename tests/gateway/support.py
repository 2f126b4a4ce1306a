"""What the gateway's tests share: the queues and timings of the session's gateway (conftest.py
starts it) that tests name too."""

TINY_QUEUE = "gw-tiny"
ECHO_QUEUE = "gw-echo"
PARKED_QUEUE = "gw-parked"  # no worker serves it until a test starts one: its jobs wait
PARKED_MODEL = "parked"
KEEPALIVE_S = 0.2
STREAM_HOLD_S = 3.0  # a stream of a job that waits in the queue begins after this, then keeps alive
