"""Every family's answer text is its tokenizer's decode of the answer's tokens
(``skip_special_tokens=True``), streamed or returned, on the family's BOS-adding
tokenizer variant: multi-byte characters split over tokens, every special token inside
the answer, and ids past the vocabulary where the output head is padded."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxvlm import generate, load, stream_generate
from mlxvlm.text.tokenization import processor_state
from tiny import GENERATIVE, make_image

FAMILIES = list(GENERATIVE)
IMAGE = make_image(84, 56, seed=3)
MESSAGES = [{"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": "Describe this image."}]}]


class Script:
    """A logits processor that makes the model emit the given ids, in order."""

    def __init__(self, ids):
        self.ids, self.step = list(ids), 0

    def __call__(self, tokens, logits):
        token = self.ids[min(self.step, len(self.ids) - 1)]
        self.step += 1
        column = mx.broadcast_to(mx.arange(logits.shape[-1]) == token, logits.shape)
        return mx.where(column, mx.array(0.0, dtype=logits.dtype),
                        mx.array(-1e9, dtype=logits.dtype))


def _head_from_args(model) -> int:
    """The output head's rows, as the config gives them (0 when it names none)."""
    text = getattr(model.args, "text_config", None) or model.args
    size = getattr(text, "vocab_size", None)
    return int(size) if size else 0


def script_for(model, processor) -> list[int]:
    tokenizer = processor.tokenizer
    text = tokenizer.encode("a red cat 中文 😀 é", add_special_tokens=False)
    added = tokenizer.backend_tokenizer.get_added_tokens_decoder()
    state = processor_state(processor)
    # A family's answer markup is kept in its text (tests/test_answer_markup.py); every
    # other special token is dropped.
    specials = sorted(i for i, t in added.items() if t.special
                      and i not in state.eos_token_ids and i not in state.answer_markup_ids)
    # Tokens past the output head's rows cannot be generated (Llama 3.2 Vision's image
    # token is the first id past its head).
    rows = getattr(getattr(model.args, "text", None), "vocab_size", None)
    specials = [i for i in specials if rows is None or i < rows]
    middle = len(text) // 2
    script = text[:middle] + specials + text[middle:]
    head = _head_from_args(model)
    if head > len(tokenizer):
        script.insert(1, head - 1)  # a padded head's row past the vocabulary
    return script


@pytest.mark.parametrize("family", FAMILIES)
def test_answer_text_is_the_tokenizers_decode(family, tiny_checkpoints):
    model, processor = load(tiny_checkpoints.bos_variant(family, "tokenizer_bos"))
    tokenizer = processor.tokenizer
    script = script_for(model, processor)
    out = generate(model, processor, MESSAGES, [IMAGE], max_tokens=len(script),
                   logits_processors=[Script(script)])
    assert out.tokens == script
    expected = tokenizer.decode(script, skip_special_tokens=True)
    assert "中文" in expected and "😀" in expected  # the case is what it claims
    assert out.text == expected or out.text == expected.lstrip(" ")
    streamed = "".join(r.text for r in stream_generate(
        model, processor, MESSAGES, [IMAGE], max_tokens=len(script),
        logits_processors=[Script(script)]))
    assert streamed == out.text
