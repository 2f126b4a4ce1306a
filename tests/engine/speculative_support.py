"""What the speculative decoding tests share: a proposer whose drafts agree with a known output
where the test says, so a test controls which drafted tokens are accepted."""

from __future__ import annotations

from producer_client.schema import SamplingParams
from worker.engine.request import Request

FILLER = 5  # drafted past the end of the known output: a stop must end the request before it


class ScriptedProposer:
    """Drafts each request's known continuation (`outputs`, by prompt), with the token at every
    output position `p` where `wrong(p)` holds replaced by another: the draft is accepted up to
    there. Past the known output it drafts FILLER tokens."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], vocab_size: int, wrong=lambda position: False):
        self.outputs = outputs
        self.vocab_size = vocab_size
        self.wrong = wrong
        self.proposed = 0

    def observe(self, chunks) -> None:
        pass

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        drafts = []
        for req, limit in zip(requests, limits):
            known = self.outputs.get(tuple(req.prompt_token_ids))
            if known is None:
                drafts.append([])  # a request the test gave no output for
                continue
            done = req.num_output_tokens
            assert req.output_token_ids == known[:done], "the output left the one it should equal"
            draft = [self._token(known, p) for p in range(done, done + limit)]
            self.proposed += len(draft)
            drafts.append(draft)
        return drafts

    def _token(self, known: list[int], position: int) -> int:
        token = known[position] if position < len(known) else FILLER
        return (token + 1) % self.vocab_size if self.wrong(position) else token


class AlwaysSpeculate:
    """In place of the adaptive choice: every step speculates, so a test knows which drafts run."""

    def speculate(self, batch: int) -> bool:
        return True

    def record(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        pass


def always_speculating(engine):
    engine.speculator.adaptive = AlwaysSpeculate()
    return engine


def speculative(make, proposer_outputs, vocab_size: int, wrong=lambda position: False, k: int = 4, **settings):
    """An engine from `make` with a ScriptedProposer drafting up to k tokens at every step."""
    engine = make(speculative_method="ngram", num_speculative_tokens=k, **settings)
    engine.speculator.proposer = ScriptedProposer(proposer_outputs, vocab_size, wrong)
    return always_speculating(engine)


def known_outputs(engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    """The outputs of `engine` (without speculation), and them by prompt for a ScriptedProposer."""
    outputs = engine.generate(prompts, params)
    return outputs, {tuple(p): o.token_ids for p, o in zip(prompts, outputs)}
