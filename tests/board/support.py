"""The queues and settings of the board's gateways (conftest.py starts them) that tests name too."""

ECHO_QUEUE = "board-echo"
PARKED_QUEUE = "board-parked"  # routed by the gateway, served by no worker: its jobs wait
API_KEY = "board-test-key"
KEEPALIVE_S = 0.2
