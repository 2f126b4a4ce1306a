"""The benchmarks, each a module run from the repository's root: `python -m bench.queue_path`,
`python -m bench.offline`... Each prints its figure beside the baseline it ran with, in the same
run; bench/RESULTS.md keeps the figures and the machines they came from."""
