"""A grammar of one token out of a fixed set: the answer of a rerank judgement is one of "yes",
"Yes", "no", "No". It plugs in where a grammar.Grammar does (PreparedRequest.grammar), without
XGrammar: the mask admits exactly those ids, so the sampled token's logprob alternatives are the
set renormalized, and P(yes) / (P(yes) + P(no)) over them equals the ratio over the whole vocabulary.
"""
from __future__ import annotations

import torch

from ninfer.engine.sampler import mask_words


class TokenChoice:
    """A grammar whose sentences are the single tokens `token_ids`."""

    def __init__(self, token_ids: list[int], vocab_size: int) -> None:
        if not token_ids or any(not 0 <= t < vocab_size for t in token_ids):
            raise ValueError(f"token choice ids must be in 0..{vocab_size - 1}")
        mask = torch.zeros((1, mask_words(vocab_size)), dtype=torch.int64)
        for t in token_ids:
            mask[0, t // 32] |= 1 << (t % 32)
        self._mask = torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)  # XGrammar's int32 words
        self.token_ids = frozenset(token_ids)

    def matcher(self) -> TokenChoiceMatcher:
        return TokenChoiceMatcher(self)


class TokenChoiceMatcher:
    """One request's position: before its token (the mask admits the set), then done."""

    def __init__(self, grammar: TokenChoice) -> None:
        self._grammar = grammar
        self._done = False

    def next_mask(self) -> torch.Tensor:
        return self._grammar._mask.clone()

    def draft_masks(self, drafts: list[int]) -> list[torch.Tensor]:
        return []  # the sentence is one token: no draft follows it

    def accept(self, token: int) -> bool:
        ok = not self._done and token in self._grammar.token_ids
        self._done = True
        return ok
