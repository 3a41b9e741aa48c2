"""Structured output's grammar layer on the default model's vocabulary: masks admit only what the
JSON grammar allows (never a special token before the value ends), and the sampler honours them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("xgrammar")

from ninfer.engine.artifact import Artifact  # noqa: E402
from ninfer.engine.batch import SequenceWork  # noqa: E402
from ninfer.engine.grammar import JsonGrammars  # noqa: E402
from ninfer.engine.request import SamplingParams  # noqa: E402
from ninfer.engine.sampler import apply_mask, sample  # noqa: E402
from ninfer.engine.tokenizer import Tokenizer  # noqa: E402
from ninfer.engine.errors import SchemaError  # noqa: E402


@pytest.fixture(scope="module")
def grammars(smollm2_artifact: Path) -> tuple[JsonGrammars, Tokenizer, int]:
    artifact = Artifact.open(smollm2_artifact)
    tok = Tokenizer.from_metadata(artifact.meta)
    vocab = artifact.meta.config.vocab_size
    return JsonGrammars(tok, vocab), tok, vocab


def allowed(mask: torch.Tensor, vocab: int) -> set[int]:
    """The ids XGrammar's own kernel leaves; the sampler's unpacking must agree with it."""
    import xgrammar as xg

    logits = torch.zeros(1, vocab)
    xg.apply_token_bitmask_inplace(logits, mask)
    ids = set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
    ours = apply_mask(torch.zeros(1, vocab), [mask])
    assert set(torch.isfinite(ours[0]).nonzero().flatten().tolist()) == ids
    return ids


def test_mask_follows_the_schema_and_ends_with_a_stop_token(grammars) -> None:
    g, tok, vocab = grammars
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    m = g.json_schema(schema, "schema", strict=True).matcher()
    first = allowed(m.next_mask(), vocab)
    assert first and all(tok.token_bytes(t).lstrip().startswith(b"{") for t in first)
    assert not first & set(tok.special_token_ids)
    for piece in ['{"ok": true', "}"]:
        for t in tok.encode(piece, add_special_tokens=False):
            assert m.accept(t), piece
    assert allowed(m.next_mask(), vocab) <= set(tok.stop_token_ids)  # the value is complete
    assert not m.accept(tok.encode("x", add_special_tokens=False)[0])


def test_sampler_draws_only_allowed_tokens(grammars) -> None:
    g, tok, vocab = grammars
    m = g.json_object().matcher()
    mask = m.next_mask()
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)) * 5
    seqs = [SequenceWork(seq_id=i, token_ids=[1], start_pos=0, block_table=[0], sample=True,
                         sampling=SamplingParams(temperature=1.0), seed=i, token_mask=mask if i == 0 else None)
            for i in range(2)]
    for _ in range(20):
        tokens, _ = sample(logits, seqs)
        assert tokens[0] in allowed(mask, vocab)
        seqs[0].seed += 1
        seqs[1].seed += 1
    assert sample(logits, seqs)[0][1] == sample(logits[1:], seqs[1:])[0][0]  # an unmasked row is untouched


def test_bad_schema_names_the_field(grammars) -> None:
    g, _, _ = grammars
    with pytest.raises(SchemaError, match="unsupported type|Unsupported type") as e:
        g.json_schema({"type": "strin"}, "response_format.json_schema.schema", strict=True)
    assert e.value.field == "response_format.json_schema.schema"
    with pytest.raises(SchemaError, match="must be a JSON Schema object"):
        g.json_schema([1], "schema", strict=False)


def test_mask_unpacking_matches_xgrammar_on_random_bitmasks() -> None:
    import xgrammar as xg

    g = torch.Generator().manual_seed(5)
    vocab = 1000  # not a multiple of 32: the last word is partial
    for _ in range(5):
        mask = torch.randint(-2**31, 2**31 - 1, (1, (vocab + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
        ref = torch.zeros(1, vocab)
        xg.apply_token_bitmask_inplace(ref, mask)
        ours = apply_mask(torch.zeros(2, vocab), [None, mask])
        assert torch.equal(torch.isinf(ours[1]), torch.isinf(ref[0])) and torch.isfinite(ours[0]).all()
