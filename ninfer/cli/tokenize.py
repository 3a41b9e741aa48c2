"""`ninfer tokenize [MODEL] TEXT`: the model's token ids for a text (no weights are loaded)."""
from __future__ import annotations

import json
from typing import List

import typer

from ninfer.cli.common import split_model_and_text


def tokenize(
    args: List[str] = typer.Argument(..., metavar="[MODEL] TEXT"),
    with_pieces: bool = typer.Option(False, "--with-pieces", help="Show each token's text piece."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    add_special: bool = typer.Option(False, "--add-special", help="Add BOS where the model wants it."),
) -> None:
    from ninfer.engine.artifact import Artifact
    from ninfer.engine.model_store import resolve_model
    from ninfer.engine.tokenizer import Tokenizer
    from ninfer.paths import cache_dir

    model, text = split_model_and_text(args, "TEXT")
    meta = Artifact.open(resolve_model(model, cache_dir(), announce=not json_out)).meta
    tok = Tokenizer.from_metadata(meta)
    ids = tok.encode(text, add_special_tokens=add_special)
    if json_out:
        out = [{"id": i, "piece": tok.id_to_piece(i)} for i in ids] if with_pieces else ids
        print(json.dumps({"tokens": out}, ensure_ascii=False))
    elif with_pieces:
        for i in ids:
            print(f"{i:>8}  {tok.id_to_piece(i)!r}")
    else:
        print(" ".join(str(i) for i in ids))
