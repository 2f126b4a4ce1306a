"""The libraries that bench/peers.py runs beside MILI. Each `<library>_app.py` holds one library's
side: the no-op task its documented worker runs, and a `Producer` that submits a job and reads its
result back through the library's documented API. They and `producer.py` run in the library's own
environment (.venv-peers/<library>, made by bench/peers.py from requirements/<library>.txt), never
in the project's; `mili_app.py` runs in the project's."""
