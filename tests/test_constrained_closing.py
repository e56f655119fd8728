"""The closing path of constrained decoding under a byte-level BPE whose merges hold runs
of brackets and quotes (``]]]]``, ``","``, as a real vocabulary does): a model that wants
such a token inside a string still closes the answer within ``max_tokens``. Before, the
path preferred ``]]]]`` (more closing bytes) inside a string, where it is just text, and
``","`` (two quotes) which closes a string only to open the next, and every one of these
answers was cut unterminated."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlxvlm.sampling.constrained import json_schema_constraint

CORPUS = ['{"a":"b","c":"d"}', '[[[[1]]]]', '"]]]]"', '{"k":["x","y"]}', "]]]] ]]]]",
          '","', '":"', "hello world"] * 50


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    bpe.add_special_tokens([AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>")


@pytest.mark.parametrize("wanted", ["]]]]", '","', "\\"])
@pytest.mark.parametrize("max_tokens", [8, 12, 20, 40])
def test_the_answer_closes_in_time_whatever_the_model_wants(tokenizer, wanted, max_tokens):
    (wanted_id,) = tokenizer.encode(wanted, add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("</s>")
    processor = json_schema_constraint(tokenizer, [eos], None).processor(max_tokens)
    vocab = len(tokenizer)
    logits = np.zeros((1, vocab), dtype=np.float32)
    logits[0, wanted_id] = 10.0  # what this "model" always wants most
    history = [0]
    for _ in range(max_tokens):
        masked = processor(mx.array([history]), mx.array(logits))
        token = int(mx.argmax(masked, axis=-1).item())
        if token == eos:
            break
        history.append(token)
    text = tokenizer.decode(history[1:])
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("pattern", ["^a+$", "^a+b$", "^(ab)+c$", "^a+bc$", "^a{12}b$"])
@pytest.mark.parametrize("max_tokens", [16, 24])
def test_a_pattern_string_closes_in_time_though_the_model_wants_more(tokenizer, pattern,
                                                                     max_tokens):
    # Inside a pattern string neither bracket is allowed, and the token the closing path
    # scores best ("a") may never end it: it must still find the way to the quote.
    import jsonschema

    (a,) = tokenizer.encode("a", add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("</s>")
    schema = {"type": "string", "pattern": pattern}
    processor = json_schema_constraint(tokenizer, [eos], schema).processor(max_tokens)
    logits = np.zeros((1, len(tokenizer)), dtype=np.float32)
    logits[0, a] = 10.0
    history = [0]
    for _ in range(max_tokens):
        token = int(mx.argmax(processor(mx.array([history]), mx.array(logits)), -1).item())
        if token == eos:
            break
        history.append(token)
    jsonschema.validate(json.loads(tokenizer.decode(history[1:])), schema)


def test_the_string_state_token_by_token_is_that_of_the_whole_text(tokenizer):
    # Inside a string a backslash escapes the next byte, whichever token it begins.
    from mlxvlm.sampling.closing_path import OUTSIDE, _after
    from mlxvlm.sampling.constrained import grammar_tokenizer

    eos = tokenizer.convert_tokens_to_ids("</s>")
    kit = grammar_tokenizer(tokenizer, [eos])
    preference, decode = kit.preference, kit.lltokenizer.decode_bytes
    pieces = [t for t in range(len(tokenizer)) if t != eos]
    rng = np.random.default_rng(0)
    # Backslashes and quotes often, so that escapes end at token boundaries.
    heavy = [tokenizer.convert_tokens_to_ids(t) for t in ('"', "\\")]
    for _ in range(50):
        tokens = rng.choice(pieces + heavy * 40, size=60).tolist()
        state, text = OUTSIDE, b""
        for token in tokens:
            state, text = preference.after(state, token), text + decode([token])
            assert state == _after(OUTSIDE, text)
