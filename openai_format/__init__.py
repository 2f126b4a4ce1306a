"""OpenAI's API as MILI speaks it, with no web framework: the requests and how they become the
client library's jobs (`requests`, `job_specs`), the responses and how job results become them
(`responses`, `render`), the errors (`errors`), the batch file's lines (`batch_lines`) and a batch
run's lines in flight (`batch_flight`). The gateway serves it over HTTP, `mili batch` over local
files; it needs pydantic and the client library only, so the plain install runs `mili batch`."""
