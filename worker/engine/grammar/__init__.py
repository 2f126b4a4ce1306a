"""Structured outputs in the engine: a request's output held to a grammar while it decodes.

constraint.py says what a request must produce (a response format, or Qwen3 tool calls), in
force from its first output token or from just after `</think>`; compiler.py compiles it once
per grammar, on a thread of its own, into a matcher per request (llguidance); request_grammar.py
follows one request's output with its matcher; masks.py turns the batch's matchers into token
bitmasks, filled while the model runs, that the sampler applies to the logits
(kernels/token_bitmask.py).
"""
