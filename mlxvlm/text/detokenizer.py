"""Streaming detokenization whose text is exactly ``tokenizer.decode(ids,
skip_special_tokens=True)``, at O(1) amortised cost per token.

The pieces of a Hugging Face ``tokenizers`` decoder are replayed token by token:

- byte-level (GPT-2, Qwen, Llama 3): each token's characters map to bytes (a token with a
  character outside the byte alphabet, e.g. an added token, contributes its UTF-8 as is),
  the byte stream is decoded with replacement of invalid sequences, as ``decode`` does;
- SentencePiece-like (Llama 2, Mistral, Gemma): "▁" becomes a space (``Replace`` or
  ``Metaspace``), runs of ``<0xNN>`` tokens (byte fallback) become their UTF-8 text, or
  one U+FFFD per byte when the run is not valid UTF-8, and a ``Strip`` after ``Fuse``
  drops leading spaces of the whole text.

Special tokens and ids the tokenizer does not know (a padded output head can emit them)
are dropped before the decoder, as ``decode`` drops them: they are invisible, even in the
middle of a character split over several tokens; ``keep_tokens`` names special tokens
whose text a sequence keeps instead (e.g. Gemma 4's thinking markers, which the server
splits on), and ``kept_token_ids`` at construction those every sequence keeps (a
family's answer markup, e.g. DeepSeek-OCR 2's grounding tags, as ``decode(ids,
skip_special_tokens=False)`` shows them): such a token ends any pending character and
adds its own text. Other decoders (WordPiece, CTC, slow
tokenizers) fall back to decoding a short window of recent tokens with the tokenizer.

The interface is mlx-lm's streaming detokenizer's (``reset``, ``add_token``,
``finalize``, ``last_segment``, ``text``, ``tokens``), so that mlx-lm's TokenizerWrapper
can carry it; its copies share the read-only token tables.
"""

from __future__ import annotations

import codecs
import json
from typing import Any, Iterable

_METASPACE = "\u2581"


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte <-> printable character table (character -> byte): printable Latin-1
    bytes stand for themselves, the others for the characters from U+0100 on in order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


def _decoder_spec(backend: Any) -> dict | None:
    decoder = backend.decoder
    if decoder is None:
        return None
    try:  # The decoder alone (its pickled state is its JSON); to_str() serialises the vocab too.
        return json.loads(decoder.__getstate__())
    except Exception:
        return json.loads(backend.to_str()).get("decoder")


class _Plan:
    """What a decoder spec does, in the shapes this module replays exactly."""

    def __init__(self, kind: str, **options):
        self.kind = kind  # "bytes", "pieces" or "window"
        self.replacements: list[tuple[str, str]] = options.get("replacements", [])
        self.metaspace: str | None = options.get("metaspace")  # its replacement character
        self.metaspace_drops_first = options.get("metaspace_drops_first", False)
        self.byte_fallback = options.get("byte_fallback", False)
        self.strip_text: tuple[str, int] = options.get("strip_text", ("", 0))


def plan_for(spec: dict | None) -> _Plan:
    if spec is None:
        return _Plan("window")  # tokens joined by spaces: the window path handles it
    steps = spec["decoders"] if spec.get("type") == "Sequence" else [spec]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"]:
        return _Plan("bytes")
    replacements, metaspace, drops_first = [], None, False
    byte_fallback, fused, strip_text = False, False, ("", 0)
    for step in steps:
        kind = step.get("type")
        per_token = not byte_fallback and not fused
        if kind == "Replace" and per_token and "String" in step.get("pattern", {}):
            replacements.append((step["pattern"]["String"], step["content"]))
        elif kind == "Metaspace" and per_token and metaspace is None:
            metaspace = step.get("replacement", _METASPACE)
            scheme = step.get("prepend_scheme")
            if scheme is None:  # older serialisations
                scheme = "always" if step.get("add_prefix_space", True) else "never"
            drops_first = scheme != "never"
        elif kind == "ByteFallback" and not byte_fallback and not fused:
            byte_fallback = True
        elif kind == "Fuse":
            fused = True
        elif kind == "Strip" and fused and step.get("stop", 0) == 0 and strip_text[1] == 0:
            strip_text = (step["content"], step.get("start", 0))
        else:
            return _Plan("window")
    return _Plan(
        "pieces",
        replacements=replacements,
        metaspace=metaspace,
        metaspace_drops_first=drops_first,
        byte_fallback=byte_fallback,
        strip_text=strip_text,
    )


def _fallback_byte(piece: str) -> int | None:
    # ByteFallback's own test: exactly "<0xNN>" with two hex digits.
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


class StreamingDetokenizer:
    """Text of a growing token sequence, equal to ``decode(tokens,
    skip_special_tokens=True)`` once finalised; held back only while a character (or a
    run of byte-fallback tokens) is incomplete."""

    def __init__(self, tokenizer: Any, kept_token_ids: Iterable[int] = ()):
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plan = plan_for(_decoder_spec(backend)) if backend is not None else _Plan("window")
        if plan.kind != "window" and _cleans_up_spaces(tokenizer, backend):
            plan = _Plan("window")  # decode() rewrites spaces around punctuation afterwards
        self._plan = plan
        self._backend = backend
        self._skipped: frozenset[int] = frozenset()
        self._kept: dict[int, str] = {}  # special token id -> its text, kept in the text
        if backend is not None:
            added = backend.get_added_tokens_decoder()
            self._skipped = frozenset(i for i, token in added.items() if token.special)
        self._alphabet = _byte_alphabet() if plan.kind == "bytes" else None
        self._pieces: dict[int, Any] = {}  # token id -> its piece (shared by copies)
        self.keep_tokens(kept_token_ids)
        self._kept_by_all = dict(self._kept)  # what every copy starts keeping
        self.reset()

    # -- state ---------------------------------------------------------------------------

    def reset(self):
        self.tokens: list[int] = []
        self._out: list[str] = []
        self._returned = 0  # pieces of _out already handed out by last_segment
        self._started = False  # a token reached the decoder (Metaspace's "first")
        self._strip_left = self._plan.strip_text[1]
        self._run = bytearray()  # pending byte-fallback bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._window: list[int] = []  # window path: tokens not yet settled
        self._window_text = ""

    def __copy__(self):
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._kept = dict(self._kept_by_all)
        clone.reset()
        return clone

    def keep_tokens(self, ids) -> None:
        """Keep these special tokens' text in this sequence's text (``decode`` drops them)."""
        backend = self._backend
        for token in ids:
            text = backend.id_to_token(token) if backend is not None else None
            if text is None:
                text = self._tokenizer.convert_ids_to_tokens(int(token))
            self._kept[int(token)] = text

    @property
    def text(self) -> str:
        return "".join(self._out)

    @property
    def last_segment(self) -> str:
        """The text added since the last call."""
        segment = "".join(self._out[self._returned :])
        self._returned = len(self._out)
        return segment

    # -- tokens --------------------------------------------------------------------------

    def add_token(self, token: int):
        self.tokens.append(token)
        if token in self._kept:
            self.finalize()  # what is pending ends before the kept token's text
            self._out.append(self._kept[token])
            return
        kind = self._plan.kind
        if kind == "window":
            self._add_window(token)
            return
        piece = self._piece(token)
        if piece is None:
            return  # special or unknown: decode() drops it before the decoder
        first = not self._started
        self._started = True
        if kind == "bytes":
            self._emit(self._utf8.decode(piece))
        elif isinstance(piece, int):
            self._run.append(piece)
        else:
            self._flush_run()
            if first and self._plan.metaspace_drops_first:
                piece = self._spm_text(self._token_string(token), first=True)
            self._emit(piece)

    def finalize(self):
        kind = self._plan.kind
        if kind == "bytes":
            self._emit(self._utf8.decode(b"", final=True))
        elif kind == "pieces":
            self._flush_run()
        elif self._window:
            self._emit(self._decode(self._window)[len(self._window_text) :])
            self._window, self._window_text = [], ""

    def token_bytes(self, token: int) -> bytes | None:
        """The bytes one token adds to the text (part of a character, maybe); None for a
        token ``decode`` drops or when this tokenizer's pieces are not known one by one."""
        if self._plan.kind == "window":
            return None
        piece = self._piece(token)
        if piece is None or isinstance(piece, bytes):
            return piece
        return bytes([piece]) if isinstance(piece, int) else piece.encode("utf-8")

    # -- pieces --------------------------------------------------------------------------

    def _token_string(self, token: int) -> str | None:
        if token < 0 or token in self._skipped:
            return None
        return self._backend.id_to_token(token)

    def _piece(self, token: int):
        """bytes (byte-level), an int (a byte-fallback byte) or str; None when dropped."""
        try:
            return self._pieces[token]
        except KeyError:
            pass
        string = self._token_string(token)
        if string is None:
            piece = None
        elif self._plan.kind == "bytes":
            alphabet = self._alphabet
            if all(c in alphabet for c in string):
                piece = bytes(alphabet[c] for c in string)
            else:  # ByteLevel keeps such a token's own UTF-8
                piece = string.encode("utf-8")
        else:
            piece = self._spm_text(string, first=False)
            if self._plan.byte_fallback:
                byte = _fallback_byte(piece)
                piece = piece if byte is None else byte
        self._pieces[token] = piece
        return piece

    def _spm_text(self, string: str, first: bool) -> str:
        for pattern, content in self._plan.replacements:
            string = string.replace(pattern, content)
        metaspace = self._plan.metaspace
        if metaspace is not None:
            string = string.replace(metaspace, "" if first and self._plan.metaspace_drops_first else " ")
        return string

    def _flush_run(self):
        if not self._run:
            return
        try:
            text = self._run.decode("utf-8")
        except UnicodeDecodeError:  # ByteFallback: one replacement character per byte
            text = "\ufffd" * len(self._run)
        self._run = bytearray()
        self._emit(text)

    def _emit(self, text: str):
        if not text:
            return
        if self._strip_left:
            content, _ = self._plan.strip_text
            while self._strip_left and text.startswith(content):
                text = text[len(content) :]
                self._strip_left -= 1
            if not text:
                return
            self._strip_left = 0
        self._out.append(text)

    # -- window path: decode() itself over the tokens since the last settled text --------

    def _decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=True)

    def _add_window(self, token: int):
        # The window starts at the last token whose text was settled, so that a token's
        # leading space (decoders strip it at the start of a text) is seen in context.
        self._window.append(token)
        text = self._decode(self._window)
        if text.endswith("\ufffd") or len(text) <= len(self._window_text):
            return  # an incomplete character (or nothing new) so far
        self._emit(text[len(self._window_text) :])
        self._window = self._window[-1:]
        self._window_text = self._decode(self._window)


def _cleans_up_spaces(tokenizer: Any, backend: Any) -> bool:
    # transformers' decode() applies clean_up_tokenization() after the decoder, except
    # for BPE models (see TokenizersBackend._decode).
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    if type(backend.model).__name__ != "BPE":
        return True
    return bool(
        getattr(
            tokenizer,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
            False,
        )
    )
