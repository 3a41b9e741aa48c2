"""Tokenizer of a model: `tokenizers` for text <-> ids, a sandboxed Jinja environment with Hugging
Face's globals for the chat template, and the special/stop ids from the artifact."""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from ninfer.engine.artifact import ArtifactMetadata, SpecialTokens
from ninfer.engine.errors import InvalidRequest, TemplateError, TokenOutOfRange
from ninfer.errors import ArtifactError

# Names a message's reasoning arrives under; templates read `reasoning_content` (gpt-oss: `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _byte_decoder() -> dict[str, int]:
    from ninfer.engine.convert.gguf_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _has_decoder(decoder: Mapping[str, Any] | None, kind: str) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == kind:
        return True
    return any(_has_decoder(d, kind) for d in decoder.get("decoders") or [])


class Tokenizer:
    """Text <-> token ids and chat rendering for one model."""

    def __init__(self, tokenizer_json: str, special: SpecialTokens, chat_template: str | None) -> None:
        try:
            self._tok = _HFTokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises bare Exceptions
            raise ArtifactError(f"tokenizer cannot be loaded ({e})") from None
        self._special = special
        self.chat_template = chat_template
        data = json.loads(tokenizer_json)
        decoder = data.get("decoder")
        self._byte_level = _has_decoder(decoder, "ByteLevel")
        self._byte_fallback = _has_decoder(decoder, "ByteFallback") or _has_decoder(decoder, "Replace")
        # SentencePiece decoders drop the space the pre-tokenizer put before the first word.
        self.strips_leading_space = _has_decoder(decoder, "Strip")
        added = data.get("added_tokens") or []
        self._added: dict[int, str] = {t["id"]: t["content"] for t in added}
        self._special_ids = frozenset(t["id"] for t in added if t.get("special"))
        self._stop_ids = frozenset(special.stop_token_ids) | (
            {special.eos_token_id} if special.eos_token_id is not None else set())
        self._tokenizer_json = tokenizer_json
        self._plain_tok: _HFTokenizer | None = None  # parse_special=False encoder, built on first use
        self._bytes: list[bytes] | None = None  # token_bytes table, built on first use
        self._templates: dict[str, jinja2.Template] = {}
        self._efforts: dict[str, tuple[str, ...] | None] = {}

    @classmethod
    def from_metadata(cls, meta: ArtifactMetadata) -> Tokenizer:
        return cls(meta.tokenizer_json, meta.special_tokens, meta.chat_template)

    # ---- properties ------------------------------------------------------------------------------

    @functools.cached_property
    def vocab_size(self) -> int:
        """Token ids run 0..vocab_size-1, added tokens included. Cached: the tokenizers library
        counts anew on each call (tens of µs on a cold cache), and the vocabulary never changes."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._special.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._special.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._special.pad_token_id

    @property
    def bos_token(self) -> str | None:
        return self._special.bos_token

    @property
    def eos_token(self) -> str | None:
        return self._special.eos_token

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    @functools.cached_property
    def special_token_strings(self) -> tuple[str, ...]:
        """The spellings of the special (control) tokens, e.g. "<|im_end|>"."""
        return tuple(self._added[i] for i in sorted(self._special_ids) if self._added.get(i))

    def added_token_id(self, spelling: str) -> int | None:
        """The id of the added (control) token spelled exactly `spelling`, or None."""
        return next((i for i, text in self._added.items() if text == spelling), None)

    @property
    def add_bos_token(self) -> bool:
        return self._special.add_bos_token

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    # ---- text <-> ids ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. parse_special: special-token text maps to its id; when False it
        is tokenized as ordinary text. With add_special_tokens, BOS is prepended when the model
        wants one (add_bos_token)."""
        tok = self._tok if parse_special else self._plain_encoder()
        ids = tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def _plain_encoder(self) -> _HFTokenizer:
        # A second instance with encode_special_tokens set (special tokens' text goes through the
        # normalizer and model like any text): toggling the flag on the shared instance would race
        # with encodes on other threads.
        if self._plain_tok is None:
            plain = _HFTokenizer.from_str(self._tokenizer_json)
            plain.encode_special_tokens = True
            self._plain_tok = plain
        return self._plain_tok

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, id: int) -> str:
        """The vocabulary entry as stored (e.g. "Ġhello", "▁hello", "<0x0A>", "<|im_end|>")."""
        piece = self._tok.id_to_token(id)
        if piece is None:
            raise TokenOutOfRange(id, self.vocab_size)
        return piece

    def token_bytes(self, id: int) -> bytes:
        """The raw bytes token `id` stands for (may be part of a UTF-8 character). SentencePiece
        tokens keep their leading space; `decode` drops it at the start of a text
        (`strips_leading_space`)."""
        table = self._bytes if self._bytes is not None else self._build_bytes()
        if not 0 <= id < len(table):
            raise TokenOutOfRange(id, len(table))
        return table[id]

    def _build_bytes(self) -> list[bytes]:
        size = self.vocab_size
        table: list[bytes] = []
        byte_of = _byte_decoder() if self._byte_level else {}
        for i in range(size):
            if i in self._added:
                table.append(self._added[i].encode("utf-8"))
                continue
            piece = self._tok.id_to_token(i)
            if piece is None:
                table.append(b"")
            elif self._byte_level:
                table.append(b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode("utf-8") for c in piece))
            elif self._byte_fallback:
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    table.append(bytes([int(piece[3:5], 16)]))
                else:
                    table.append(piece.replace("▁", " ").encode("utf-8"))
            else:
                table.append(self._tok.decode([i], skip_special_tokens=False).encode("utf-8"))
        self._bytes = table
        return table

    # ---- chat template ---------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, **extra: Any) -> str:
        """Render `messages` with the model's chat template (or `chat_template`) as transformers'
        `apply_chat_template(..., tokenize=False)` would. Raises TemplateError when the template
        raises or the model has none."""
        template = self._compiled(chat_template)
        # llama.cpp's date_string (Llama 3.x templates print it; without it they fall back to a fixed date)
        context: dict[str, Any] = {"date_string": datetime.now().strftime("%d %b %Y")}
        for name in ("bos_token", "eos_token"):
            value = getattr(self._special, name)
            if value is not None:
                context[name] = value
        context.update(_plain(extra))
        chat = [_normalize_message(m) for m in messages]
        try:
            return template.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                   add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template error: {e.message or e}", field="messages") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
            raise TemplateError(f"chat template failed on these messages: {e}", field="messages") from None

    def check_chat_template(self) -> None:
        """Compile the chat template and render a one-turn chat with it (then, for templates that
        need one, a system turn and a user turn): raises TemplateError saying what fails, so a
        broken template is refused before serving instead of failing every chat request."""
        if not self.chat_template:
            return
        try:
            _environment().from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"the chat template does not compile: {e} (line {e.lineno})",
                                field="chat_template") from None
        tries = ([{"role": "user", "content": "Hello"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
        for i, messages in enumerate(tries):
            try:
                self.apply_chat_template(messages, add_generation_prompt=True)
                return
            except TemplateError as e:
                if i == len(tries) - 1:
                    raise TemplateError(f"the chat template cannot render a one-message chat: {e}",
                                        field="chat_template") from None
            except Exception as e:  # noqa: BLE001 - any failure of a template function
                if i == len(tries) - 1:
                    raise TemplateError(f"the chat template cannot render a one-message chat: "
                                        f"{type(e).__name__}: {e}", field="chat_template") from None

    def accepted_efforts(self, candidates: tuple[str, ...], chat_template: str | None = None) -> tuple[str, ...] | None:
        """The reasoning efforts of `candidates` the template renders a one-message chat with, tried
        once per template. None: the template rejects every value, or cannot render that chat at all
        (a request's value then renders as it is, with its own error)."""
        source = chat_template if chat_template is not None else self.chat_template
        if (source or "") in self._efforts:
            return self._efforts[source or ""]
        chat = [{"role": "user", "content": "Hello"}]

        def renders(**kwargs: Any) -> bool:
            try:
                self.apply_chat_template(chat, add_generation_prompt=True, chat_template=chat_template, **kwargs)
                return True
            except Exception:  # noqa: BLE001 - a template's raise_exception or any failure of its functions
                return False

        accepted = tuple(v for v in candidates if renders(reasoning_effort=v)) if renders() else ()
        self._efforts[source or ""] = accepted or None
        return accepted or None

    def _compiled(self, chat_template: str | None) -> jinja2.Template:
        source = chat_template if chat_template is not None else self.chat_template
        if not source:
            raise TemplateError("this model has no chat template; send a prompt instead", field="messages")
        cached = self._templates.get(source)
        if cached is None:
            try:
                cached = _environment().from_string(source)
            except jinja2.TemplateSyntaxError as e:
                if chat_template is not None:
                    raise TemplateError(f"chat_template does not compile: {e}", field="chat_template") from None
                raise ArtifactError(f"the model's chat template does not compile: {e}") from None
            self._templates[source] = cached
        return cached


# ---- Jinja environment (mirrors transformers' chat_template_utils) ------------------------------

def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates want plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that rejects underscore attributes (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        for name in dict(*args, **kwargs):
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, *args, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set attribute {name!r} on a namespace")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    env.globals["dict"] = lambda *a, **k: dict(*a, **k)
    return env


def _plain(value: Any) -> Any:
    """Plain JSON-like data only (no objects with methods reach the sandbox)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return str(value)


def _normalize_message(message: Any) -> dict[str, Any]:
    # As transformers: keys whose value is None are dropped (templates test `is defined`), and the
    # reasoning is exposed under every name templates read.
    plain = _plain(message)
    if not isinstance(plain, dict):
        raise InvalidRequest(f"each message must be an object, got {type(message).__name__}", field="messages")
    plain = {k: v for k, v in plain.items() if v is not None}
    reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain
