"""Streamed text equals ``tokenizer.decode(ids, skip_special_tokens=True)``: byte 0x00,
special and added tokens, ids past the vocabulary and characters split over several
tokens, on tokenizers shaped like the Hub's (byte-level BPE as Qwen2's, SentencePiece-like
BPE with byte fallback as Llama's and Gemma's, Metaspace, WordPiece), and end to end
through ``generate``/``stream_generate`` on a tiny checkpoint."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import mlx.core as mx
import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from tiny import make_image
from mlxvlm import generate, load, stream_generate
from mlxvlm.sampling.defaults import NO_CHECKPOINT_DEFAULTS
from mlxvlm.text.tokenization import attach_processor_state, generation_tokenizer, processor_state

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A red circle, a blue square and a green triangle.",
    "Describe the picture: what is in it?",
    "日本語のテキストと中文文本。",
    "Café, naïve, façade, über.",
    "Emoji: 😀 🎉 👍🏽 and ❤️.",
]
# Characters the streams are made of: ASCII, accented Latin, CJK, emoji (4 bytes, with a
# skin-tone modifier and a variation selector), and a NUL byte.
TEXTS = [
    "Hello world, a red circle.",
    "中文 and 日本語 mixed",
    "😀🎉 👍🏽 ❤️ done",
    "zero\x00byte and naïve café",
    "Ünïcödé 🤖 robots 机器人",
]
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """Qwen2's shape: split regex + ByteLevel, ByteLevel decoder, special and non-special
    added tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>")
    ])
    tok.add_tokens([
        AddedToken("<tool_call>", special=False, normalized=False),
        AddedToken("héllo wörld", special=False, normalized=False),
    ])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def _spm_like(decoder, normalizer, specials, bos: bool) -> PreTrainedTokenizerFast:
    """A BPE over "▁"-joined text with byte fallback: <unk>, <s>, </s>, then the 256
    <0xNN> byte tokens, then the learned pieces (limit_alphabet keeps CJK and emoji out, so
    they go through byte fallback)."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
        limit_alphabet=40,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    # The trainer registers its special tokens as special added tokens; in Hub files only
    # <unk>, <s> and </s> are, the byte tokens are plain vocabulary entries.
    learned = json.loads(tok.to_str())["model"]
    tok = Tokenizer(models.BPE(
        vocab=learned["vocab"], merges=[tuple(m) for m in learned["merges"]],
        unk_token="<unk>", byte_fallback=True, fuse_unk=True,
    ))
    tok.normalizer = normalizer
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.decoder = decoder
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken("<extra_id>", special=False, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def llama_like() -> PreTrainedTokenizerFast:
    """Llama 2's shape: a "▁" prepended by the normalizer and stripped by the decoder, BOS
    added by the post-processor."""
    return _spm_like(
        decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]),
        normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
        ["[INST]", "[/INST]"],
        bos=True,
    )


def gemma_like() -> PreTrainedTokenizerFast:
    """Gemma's shape: no prepended "▁", no strip, turn markers as special tokens."""
    return _spm_like(
        decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]),
        normalizers.Replace(" ", "▁"),
        ["<start_of_turn>", "<end_of_turn>", "<image_soft_token>"],
        bos=True,
    )


def metaspace_like() -> PreTrainedTokenizerFast:
    """A Metaspace decoder (newer SentencePiece conversions), with byte fallback."""
    return _spm_like(
        decoders.Sequence([
            decoders.Metaspace(replacement="▁", prepend_scheme="first"),
            decoders.ByteFallback(), decoders.Fuse(),
        ]),
        normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
        ["<mask>"],
        bos=False,
    )


TOKENIZERS = {
    "byte_level_bpe": byte_level_bpe,
    "llama_like": llama_like,
    "gemma_like": gemma_like,
    "metaspace_like": metaspace_like,
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]()


def stream(tokenizer, ids) -> tuple[str, list[str]]:
    """Text as generation streams it: the detokenizer generation_tokenizer() hands out,
    one segment per token, then the finalised rest."""
    detokenizer = generation_tokenizer(SimpleNamespace(tokenizer=tokenizer)).detokenizer
    segments = []
    for token in ids:
        detokenizer.add_token(token)
        segments.append(detokenizer.last_segment)
    detokenizer.finalize()
    segments.append(detokenizer.last_segment)
    assert detokenizer.text == "".join(segments)
    return "".join(segments), segments


def expected(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def assert_streams_as_decoded(tokenizer, ids):
    text, segments = stream(tokenizer, ids)
    want = expected(tokenizer, ids)
    assert text == want, (ids, segments)
    return text


def special_ids(tokenizer) -> list[int]:
    added = tokenizer.backend_tokenizer.get_added_tokens_decoder()
    return sorted(i for i, token in added.items() if token.special)


def byte_tokens(tokenizer, data: bytes) -> list[int]:
    """One token per byte: byte-level alphabet characters or <0xNN> tokens."""
    vocab = tokenizer.get_vocab()
    if "<0x00>" in vocab:
        return [vocab[f"<0x{b:02X}>"] for b in data]
    return [tokenizer.convert_tokens_to_ids(_byte_char(b)) for b in data]


def _byte_char(b: int) -> str:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if b in printable:
        return chr(b)
    return chr(0x100 + [x for x in range(256) if x not in printable].index(b))


def test_encoded_texts_stream_as_decoded(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)  # with the BOS the post-processor adds, if any
        assert_streams_as_decoded(tokenizer, ids)
        assert_streams_as_decoded(tokenizer, tokenizer.encode(text, add_special_tokens=False))


def test_byte_zero_is_a_nul_character(tokenizer):
    ids = tokenizer.encode("red circle", add_special_tokens=False)
    assert len(ids) > 1
    zero = byte_tokens(tokenizer, b"\x00")
    text = assert_streams_as_decoded(tokenizer, ids[:1] + zero + ids[1:])
    assert "\x00" in text and "Ā" not in text


def test_every_special_token_inside_an_answer_is_invisible(tokenizer):
    words = tokenizer.encode("red circle", add_special_tokens=False)
    plain = expected(tokenizer, words)
    for special in special_ids(tokenizer):
        for at in range(len(words) + 1):
            ids = words[:at] + [special] + words[at:]
            assert assert_streams_as_decoded(tokenizer, ids) == plain


def test_added_tokens_special_and_not(tokenizer):
    added = tokenizer.backend_tokenizer.get_added_tokens_decoder()
    words = tokenizer.encode("blue square", add_special_tokens=False)
    for token_id in sorted(added):
        ids = words[:1] + [token_id] + words[1:] + [token_id]
        text = assert_streams_as_decoded(tokenizer, ids)
        if not added[token_id].special:
            assert added[token_id].content.replace("▁", " ").strip() in text


def test_ids_past_the_vocabulary_are_invisible(tokenizer):
    words = tokenizer.encode("green triangle", add_special_tokens=False)
    past = len(tokenizer)
    for extra in (past, past + 1, past + 37):
        text = assert_streams_as_decoded(tokenizer, words[:1] + [extra] + words[1:])
        assert "!" not in text
        assert text == expected(tokenizer, words)


@pytest.mark.parametrize("char", ["中", "語", "é", "😀", "👍🏽", "❤️", "🤖"])
def test_characters_split_over_byte_tokens(tokenizer, char):
    pieces = byte_tokens(tokenizer, char.encode("utf-8"))
    words = tokenizer.encode("a b", add_special_tokens=False)
    ids = words + pieces + words
    text, segments = stream(tokenizer, ids)
    assert text == expected(tokenizer, ids)
    assert char in text and "\ufffd" not in text
    # A special token and an unknown id inside the character do not break it.
    special = special_ids(tokenizer)[-1]
    broken_up = words + pieces[:1] + [special, len(tokenizer) + 3] + pieces[1:] + words
    assert assert_streams_as_decoded(tokenizer, broken_up) == text


def test_no_partial_character_is_ever_streamed(tokenizer):
    ids = (
        tokenizer.encode("中文 😀 ok", add_special_tokens=False)
        + byte_tokens(tokenizer, "🎉".encode())
        + tokenizer.encode("ok", add_special_tokens=False)
    )
    text, segments = stream(tokenizer, ids)
    assert "🎉" in text
    assert all("\ufffd" not in s for s in segments)


def test_invalid_bytes_become_replacement_characters_as_decode_does(tokenizer):
    words = tokenizer.encode("ok", add_special_tokens=False)
    cut = byte_tokens(tokenizer, "中".encode()[:2])
    lone = byte_tokens(tokenizer, b"\xff\x80")
    for ids in (words + cut + words, cut, words + lone, cut + lone + cut + words, words + cut):
        text = assert_streams_as_decoded(tokenizer, ids)
        assert "\ufffd" in text


def test_random_token_streams_match_decode(tokenizer):
    rng = random.Random(0)
    specials = special_ids(tokenizer)
    byte_ids = byte_tokens(tokenizer, bytes(range(256)))
    size = len(tokenizer)
    pools = [list(range(size)), specials, byte_ids, [size, size + 5]]
    for _ in range(150):
        ids = [rng.choice(rng.choices(pools, weights=[6, 1, 4, 1])[0]) for _ in range(rng.randint(1, 24))]
        text, segments = stream(tokenizer, ids)
        assert text == expected(tokenizer, ids), ids


def test_streaming_never_re_decodes(tokenizer, monkeypatch):
    # The known decoder shapes are replayed per token: tokenizer.decode is never called,
    # so each token costs O(1) whatever the answer's length.
    ids = tokenizer.encode(" ".join(TEXTS) * 4, add_special_tokens=False)
    want = expected(tokenizer, ids)
    detokenizer = generation_tokenizer(SimpleNamespace(tokenizer=tokenizer)).detokenizer

    def no_decode(*args, **kwargs):
        raise AssertionError("decode called while streaming")

    monkeypatch.setattr(type(tokenizer), "decode", no_decode)
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == want


def test_copies_stream_independently(tokenizer):
    wrapper = generation_tokenizer(SimpleNamespace(tokenizer=tokenizer))
    first, second = wrapper.detokenizer, wrapper.detokenizer
    a = tokenizer.encode("red circle", add_special_tokens=False)
    b = tokenizer.encode("中文 😀", add_special_tokens=False)
    for x, y in zip(a, b):
        first.add_token(x)
        second.add_token(y)
    for x in a[len(b):]:
        first.add_token(x)
    for y in b[len(a):]:
        second.add_token(y)
    first.finalize()
    second.finalize()
    assert (first.text, second.text) == (expected(tokenizer, a), expected(tokenizer, b))


def wordpiece() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]")


def test_other_decoders_fall_back_to_windowed_decode():
    tokenizer = wordpiece()
    for text in ("the quick brown fox, jumps!", "a red circle and a blue square."):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert_streams_as_decoded(tokenizer, ids)
        assert_streams_as_decoded(tokenizer, ids[:2] + [2] + ids[2:])


# -- end to end on a tiny checkpoint ------------------------------------------------------


class Script:
    """A logits processor that makes the model emit the given ids, in order."""

    def __init__(self, ids):
        self.ids = list(ids)
        self.step = 0

    def __call__(self, tokens, logits):
        forced = mx.full(logits.shape, -1e9, dtype=logits.dtype)
        token = self.ids[min(self.step, len(self.ids) - 1)]
        self.step += 1
        column = mx.arange(logits.shape[-1]) == token
        return mx.where(column, mx.array(0.0, dtype=logits.dtype), forced)


@pytest.fixture(scope="module")
def qwen(tiny_checkpoints):
    return load(tiny_checkpoints.path("qwen2_vl", "hub"))


def test_generate_text_equals_decode_of_its_tokens(qwen):
    model, processor = qwen
    tokenizer = processor.tokenizer
    head = model.config["text_config"]["vocab_size"] if "text_config" in model.config else model.config["vocab_size"]
    assert head > len(tokenizer)  # the output head is padded past the vocabulary
    words = tokenizer.encode("a red cat", add_special_tokens=False)
    specials = [i for i in special_ids(tokenizer) if i not in processor_state(processor).eos_token_ids]
    script = (
        words[:1]
        + byte_tokens(tokenizer, b"\x00")
        + byte_tokens(tokenizer, "😀".encode())[:2]
        + specials[:1]
        + [head - 1]
        + byte_tokens(tokenizer, "😀".encode())[2:]
        + words[1:]
        + byte_tokens(tokenizer, "中".encode())
    )
    image = make_image(112, 84, seed=1)
    out = generate(
        model, processor, "Describe this image.", image,
        max_tokens=len(script), logits_processors=[Script(script)],
    )
    assert out.tokens == script
    assert out.text == tokenizer.decode(out.tokens, skip_special_tokens=True)
    assert "\x00" in out.text and "😀" in out.text and out.text.endswith("中")
    assert "!" not in out.text and "Ā" not in out.text
    streamed = "".join(
        r.text for r in stream_generate(
            model, processor, "Describe this image.", image,
            max_tokens=len(script), logits_processors=[Script(script)],
        )
    )
    assert streamed == out.text


def test_kept_special_tokens_show_where_they_come(tokenizer):
    # A sequence may keep some special tokens' text (Gemma 4's thinking markers); the
    # others stay invisible, and the next sequence's copy keeps none.
    words = tokenizer.encode("red circle blue", add_special_tokens=False)
    plain = expected(tokenizer, words)
    kept, *dropped = special_ids(tokenizer)
    content = tokenizer.convert_ids_to_tokens(kept)
    wrapper = generation_tokenizer(SimpleNamespace(tokenizer=tokenizer))
    for at in range(len(words) + 1):
        detokenizer = wrapper.detokenizer
        detokenizer.keep_tokens([kept])
        for token in words[:at] + [kept] + dropped[:1] + words[at:]:
            detokenizer.add_token(token)
        detokenizer.finalize()
        before = detokenizer.text.index(content)
        assert detokenizer.text.replace(content, "", 1) == plain
        assert before == len(expected(tokenizer, words[:at]))
    assert stream(tokenizer, words[:1] + [kept] + words[1:])[0] == plain  # a fresh copy


def test_a_familys_answer_markup_is_kept_by_every_sequence(tokenizer):
    # A family's answer markup (DeepSeek-OCR 2's <|ref|>/<|det|>) is named at load: every
    # copy the wrapper hands out keeps it, as decode(skip_special_tokens=False) shows it,
    # and still drops the other special tokens; a sequence's own kept tokens do not leak.
    markup, other, *_ = special_ids(tokenizer)
    state = attach_processor_state(SimpleNamespace(tokenizer=tokenizer), set(),
                                   NO_CHECKPOINT_DEFAULTS,
                                   [tokenizer.convert_ids_to_tokens(markup), "<|not-a-token|>"])
    assert state.answer_markup_ids == {markup}
    words = tokenizer.encode("red circle blue", add_special_tokens=False)
    ids = words[:1] + [markup] + words[1:2] + [other, markup] + words[2:]
    want = tokenizer.decode([t for t in ids if t != other], skip_special_tokens=False)
    for _ in range(2):  # each copy
        detokenizer = state.generation_tokenizer.detokenizer
        for token in ids:
            detokenizer.add_token(token)
        detokenizer.finalize()
        assert detokenizer.text == want
        detokenizer.keep_tokens([other])  # this sequence's own: not the next one's
