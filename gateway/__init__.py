"""MILI's HTTP gateway: an OpenAI-compatible API over the queue. A stateless process that
speaks to Redis through the producer client library only: no engine, no torch."""
