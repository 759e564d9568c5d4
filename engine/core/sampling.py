"""Choosing each request's next token from its logits: logit bias, presence and frequency penalties, greedy or
temperature and nucleus sampling, and the log probabilities a request asked for."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Greedy when temperature is 0, else temperature and nucleus (top-p) sampling, over (1, vocab) logits."""
    return _choose(finite(logits[0]), temperature, top_p, generator)


def finite(logits: torch.Tensor) -> torch.Tensor:
    """A float32 copy in which no NaN or infinity can win or poison the choice."""
    return torch.nan_to_num(logits.float(), nan=-1e9, posinf=1e9, neginf=-1e9)


def _choose(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens at this step and their log probabilities


@dataclass
class Sampler:
    """One request's choice of the next token: logit bias, presence and frequency penalties over the tokens it has
    generated, then greedy or temperature/top-p `sample`. With `top_logprobs` set (0 to 20) it also keeps each
    chosen token's log probability and the most likely alternatives, from the logits it chose on. With a `grammar`,
    tokens it does not allow are masked out before the choice, in greedy and sampled decoding alike."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator = field(default_factory=torch.Generator)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int | None = None
    grammar: object | None = None  # structured.matcher.GrammarMatcher: what the answer may be, token by token
    counts: dict[int, int] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def __call__(self, logits: torch.Tensor) -> int:
        logits = finite(logits[0])
        if self.logit_bias:
            ids, values = zip(*self.logit_bias)
            logits[list(ids)] += torch.tensor(values)
        if self.counts and (self.presence_penalty or self.frequency_penalty):
            ids = torch.tensor(list(self.counts))
            seen = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            logits[ids] -= self.presence_penalty + self.frequency_penalty * seen
        token = self._choose_within_grammar(logits) if self.grammar is not None else self._choose(logits, None)
        self.counts[token] = self.counts.get(token, 0) + 1
        return token

    def _choose(self, logits: torch.Tensor, ids) -> int:
        """The choice among `logits`, whose token ids are `ids` (None: their positions), with its logprobs."""
        choice = _choose(logits, self.temperature, self.top_p, self.generator)
        token = choice if ids is None else int(ids[choice])
        if self.top_logprobs is not None:
            log_probs = torch.log_softmax(logits, dim=-1)
            top = torch.topk(log_probs, min(self.top_logprobs, len(log_probs))) if self.top_logprobs else None
            self.logprobs.append(TokenLogprob(token, float(log_probs[choice]), tuple(
                (index if ids is None else int(ids[index]), value)
                for index, value in zip(top.indices.tolist(), top.values.tolist())
                if value != float("-inf")) if top is not None else ()))  # tokens the grammar ruled out are not shown
        return token

    def _choose_within_grammar(self, logits: torch.Tensor) -> int:
        """The choice among the tokens the grammar allows. Where the choice over all tokens is already allowed, it
        stands: exactly so for greedy, and for sampling without top-p too (a sample from all tokens kept when allowed,
        else one from the allowed ones, is a sample from the allowed ones). A model that follows the grammar of its
        own accord (most tokens of a real model's JSON) costs a bit test, not a masked choice. Logprobs need the
        allowed ones'."""
        grammar = self.grammar
        if self.top_logprobs is None and (self.temperature <= 0 or self.top_p >= 1.0):
            token = _choose(logits, self.temperature, self.top_p, self.generator)
            if grammar.allows(token):
                grammar.accept(token)
                return token
        token = self._choose(*grammar.narrow(logits))
        grammar.accept(token)
        return token

    def forced(self, most: int) -> list[int]:
        """Up to `most` tokens the answer's grammar allows alone after the last choice, taken as choices of their
        own (counted for penalties); none where logprobs are asked (each token's would need its own step)."""
        if self.grammar is None or self.top_logprobs is not None:
            return []
        tokens = self.grammar.forced(most)
        for token in tokens:
            self.counts[token] = self.counts.get(token, 0) + 1
        return tokens

    @property
    def greedy(self) -> bool:
        """Takes the largest logit, after bias and penalties, with no grammar: a drafted token can be checked against
        its choice row by row (a grammar's masks are computed beside the step, one token ahead)."""
        return self.temperature <= 0 and self.grammar is None

    @property
    def done(self) -> bool:
        """The answer's grammar is complete: only an end token could follow."""
        return self.grammar is not None and self.grammar.done
