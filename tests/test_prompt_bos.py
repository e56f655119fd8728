"""Prompt tokens exactly as transformers builds them, for tokenizers that add BOS.

transformers' ``processor.apply_chat_template(..., tokenize=True)`` tokenizes the
rendered chat with the tokenizer's special tokens unless it already starts with the BOS
token. The fixtures' own tokenizers add nothing, so every family here runs on BOS
variants of its tiny checkpoint (tests/tiny/bos.py): the same model with a tokenizer
whose post-processor prepends BOS, as real Llama, Mistral and Gemma tokenizers do, and a
template that does or does not start with BOS. For each, our prompt ids and greedy tokens
(through ``mlxvlm.load`` and ``stream_generate``) must be what transformers gives:
``apply_chat_template(tokenize=True)`` on the transformers processor built from the
variant's tokenizer and the tiny model's other parts, and ``generate`` on the model.
"""

from __future__ import annotations

import copy
import functools
from typing import NamedTuple

import pytest

from parity import MIN_REFERENCE_MARGIN, our_tokens, with_images
from tiny import GENERATIVE, builder, make_image
from tiny.bos import plan
from mlxvlm import load
from mlxvlm.prompt import prepare_inputs, special_tokens_option

torch = pytest.importorskip("torch")

# transformers' processors trip numpy's copy-keyword deprecation on torch tensors
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FAMILIES = list(GENERATIVE)
IMAGE = make_image(84, 56, seed=2)
MESSAGES = [{"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": "Describe this image."}]}]
# Processors that never tokenize with the tokenizer's special tokens (LFM2-VL's sets
# ``add_special_tokens=False``: its templates write the BOS), in transformers and here.
NO_SPECIAL_TOKENS = {"lfm2_vl"}
# Processors that write the BOS token into a prompt lacking it, before the tokenizer adds
# its own (MllamaProcessor's ``build_string_from_input``): a template that leaves BOS out
# gets two, in transformers and here.
WRITES_BOS_AS_TEXT = {"mllama"}
NEW_TOKENS = 5  # a few greedy steps are enough to see the prompt's effect


class Variant(NamedTuple):
    name: str  # family/kind
    model: object  # ours, through mlxvlm.load
    processor: object
    reference_processor: object  # transformers', over the variant's tokenizer
    bos_id: int | None  # the token the tokenizer prepends
    eos_id: int | None  # the token it appends, if any
    input_ids: list[int]  # transformers' prompt ids
    tokens: list[int]  # transformers' greedy tokens
    margin: float  # thinnest top-1/top-2 margin over them

    def __repr__(self) -> str:
        return f"Variant({self.name})"


def transformers_side(tiny, reference_processor, messages, images):
    inputs = reference_processor.apply_chat_template(
        with_images(messages, images), tokenize=True, return_dict=True,
        add_generation_prompt=True, return_tensors="pt",
    )
    with torch.no_grad():
        out = tiny.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False,
                                  output_scores=True, return_dict_in_generate=True)
    ids = inputs["input_ids"][0].tolist()
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return ids, out.sequences[0, len(ids):].tolist(), min(margins)


@pytest.fixture(scope="module")
def variant(tiny_checkpoints):
    """(family, kind) -> ``Variant``, each built once."""
    from transformers import AutoTokenizer

    @functools.cache
    def run(family: str, kind: str) -> Variant:
        path = tiny_checkpoints.bos_variant(family, kind)
        spec = plan(tiny_checkpoints.path(family, "transformers"), kind)
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = tokenizer.convert_tokens_to_ids
        bos_id, eos_id = ids(spec.prepended), spec.appended and ids(spec.appended)
        # The fixture is what it claims: the tokenizer as transformers loads it adds them.
        assert tokenizer("Hi")["input_ids"][0] == bos_id
        assert (tokenizer("Hi")["input_ids"][-1] == eos_id) == (eos_id is not None)
        tiny = copy.copy(tiny_checkpoints.model(family))
        tiny.tokenizer = tokenizer
        reference_processor = builder(family).reference_processor(tiny)
        reference_processor.chat_template = spec.chat_template
        model, processor = load(path)
        return Variant(f"{family}/{kind}", model, processor, reference_processor, bos_id, eos_id,
                       *transformers_side(tiny, reference_processor, MESSAGES, [IMAGE]))

    return run


def our_input_ids(v: Variant) -> list[int]:
    inputs = prepare_inputs(v.processor, MESSAGES, [IMAGE], feature_names=v.model.feature_names)
    return inputs.input_ids[0].tolist()


def assert_matches_transformers(v: Variant) -> list[int]:
    """Our prompt ids and greedy tokens are transformers'; returns the ids."""
    ids = our_input_ids(v)
    assert ids == v.input_ids
    assert len(v.tokens) == NEW_TOKENS, "the reference stopped early; pick another prompt"
    assert v.margin > MIN_REFERENCE_MARGIN, f"top-1/top-2 margin {v.margin:.2e} is too thin"
    assert our_tokens(v.model, v.processor, MESSAGES, [IMAGE], max_tokens=NEW_TOKENS) == v.tokens
    return ids


def without_special_tokens(v: Variant) -> list[int]:
    """The prompt tokenized with no special tokens at all (mlxvlm's rule before)."""
    text = v.reference_processor.apply_chat_template(MESSAGES, add_generation_prompt=True)
    out = v.reference_processor(text=[text], images=[IMAGE], add_special_tokens=False)
    return list(out["input_ids"][0])


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bos_the_template_leaves_out_is_added(family, variant):
    """The tokenizer adds BOS, the template writes none: transformers tokenizes with the
    special tokens, and so do we. Without them the prompt would lose its BOS."""
    v = variant(family, "tokenizer_bos")
    ids = assert_matches_transformers(v)
    if family in NO_SPECIAL_TOKENS:
        assert ids == without_special_tokens(v) and v.bos_id not in ids
        return
    if family in WRITES_BOS_AS_TEXT:
        assert ids[:2] == [v.bos_id, v.bos_id] and without_special_tokens(v) == ids[1:]
        return
    assert ids.count(v.bos_id) == 1
    if family == "paligemma":  # its processor places BOS (after the images) itself
        assert ids == without_special_tokens(v)
    else:
        assert ids[0] == v.bos_id
        assert without_special_tokens(v) == ids[1:]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bos_the_template_writes_is_not_doubled(family, variant):
    """The tokenizer adds BOS and the template starts with it: tokenized without the
    special tokens, one BOS."""
    v = variant(family, "template_bos")
    ids = assert_matches_transformers(v)
    assert ids[0] == v.bos_id and ids[1] != v.bos_id
    assert ids == without_special_tokens(v)


def test_paligemma_has_one_bos_after_its_images(variant):
    """PaliGemma's processor puts BOS between the image tokens and the text and keeps
    its tokenizer from adding one: with a BOS-adding tokenizer, still one, there."""
    v = variant("paligemma", "tokenizer_bos")
    image_id = v.processor.image_token_id
    ids = our_input_ids(v)
    first_text = next(i for i, t in enumerate(ids) if t != image_id)
    assert first_text > 0 and ids[first_text] == v.bos_id
    assert ids.count(v.bos_id) == 1


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_a_tokenizer_that_also_adds_eos(family, variant):
    """With the special tokens the tokenizer's EOS comes too, as in transformers (the
    answer follows it); a template that writes BOS keeps both out."""
    v = variant(family, "tokenizer_bos_eos")
    ids = assert_matches_transformers(v)
    assert [ids[0], ids[-1]] == [v.bos_id, v.eos_id]
    assert without_special_tokens(v) == ids[1:-1]
    v = variant(family, "template_bos_eos")
    ids = assert_matches_transformers(v)
    assert ids[0] == v.bos_id and ids == without_special_tokens(v)


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_a_tokenizer_without_a_bos_token_keeps_its_special_tokens(family, variant):
    """transformers' rule needs the tokenizer's bos_token: a tokenizer with none (Qwen's)
    is tokenized with its special tokens whatever the prompt starts with, so a token it
    prepends comes twice if the template wrote it too; we follow."""
    v = variant(family, "unnamed_bos")
    assert v.processor.tokenizer.bos_token is None
    ids = assert_matches_transformers(v)
    assert ids[:2] == [v.bos_id, v.bos_id]


# ------------------------------------------------------------------------------ units


def test_a_raw_prompt_gets_the_processors_default_special_tokens(variant):
    """raw_prompt=True is tokenized as ``processor(text=prompt)`` is: with the BOS."""
    v = variant("llava", "tokenizer_bos")
    text = v.reference_processor.apply_chat_template(MESSAGES, add_generation_prompt=True)
    inputs = prepare_inputs(v.processor, text, [IMAGE], raw_prompt=True)
    expected = v.reference_processor(text=[text], images=[IMAGE])["input_ids"][0]
    assert inputs.input_ids[0].tolist() == list(expected)
    assert inputs.input_ids[0, 0].item() == v.bos_id


class _Tokenizer:
    def __init__(self, bos_token):
        self.bos_token = bos_token


class _Processor:
    def __init__(self, bos_token):
        self.tokenizer = _Tokenizer(bos_token)


@pytest.mark.parametrize("bos,text,expected", [
    ("<s>", "<s>[INST] Hi [/INST]", {"add_special_tokens": False}),
    ("<s>", "[INST] Hi [/INST]", {}),
    ("<s>", " <s>[INST] Hi [/INST]", {}),  # starts with it, not contains it
    (None, "<|im_start|>user\nHi", {}),
    (None, "<s>Hi", {}),
])
def test_special_tokens_option_is_transformers_rule(bos, text, expected):
    assert special_tokens_option(_Processor(bos), text) == expected
