"""Speculative decoding: a proposer drafts the next few tokens of each decoding request, and one
step of the model verifies them all (Leviathan et al. 2023; Chen et al. 2023).

A request with a draft d_1..d_n extends its last token and the draft in one chunk of n + 1 query
tokens: the extend path attends them causally to the cached prefix, reading the request's KV once
however many tokens it checks, so while a step is bound by memory a verified token costs little
more than a decoded one. The step samples at each of the n + 1 positions exactly what the engine
without speculation would sample there had the request produced the draft's tokens so far
(verify.Lookahead): the same processors, masks and random draws. The reader takes the draws in
order while each equals the draft's next token; the first that differs, or the draw after the
whole draft, is the request's too. So every output token is the target's own draw: greedy output
is the engine's without speculation, token for token, and a seeded job draws the same tokens.

Rejected tokens leave no trace: their KV slots lie past the request's computed tokens (only an
accepted draft token's KV is counted, and shared with the prefix cache), and the next step writes
over them.

Proposers (per worker, `speculative_method`): `ngram` (ngram.py, no model).
"""
