"""What every parity test against transformers shares: tolerances, the standard cases,
the loaded-model and reference fixtures, our side's logits and greedy tokens, and the
assertions (parity and the guards that show a test can fail) that the families repeat.

A test module defines ``ALL_CASES``: case name -> (chat messages, images), usually from
``standard_cases``. Import the fixtures into it (``from parity import loaded, reference``)
to use them, or make its own ``reference`` with ``reference_fixture``.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxvlm import batch_generate, generate, load, stream_generate
from mlxvlm.models import get_family
from mlxvlm.prompt import prepare_inputs

LOGITS_ATOL = 1e-4
NEW_TOKENS = 24
# Greedy parity is meaningful only if float32 rounding cannot flip a token.
MIN_REFERENCE_MARGIN = 1e-3
# How far a deliberately broken model's logits must land from the reference's for a guard
# to count it as caught: far outside the parity tolerance.
CAUGHT = 100 * LOGITS_ATOL


class Reference(NamedTuple):
    """transformers' side of a case."""

    input_ids: list[int]
    logits: np.ndarray  # first forward pass, (prompt_length, vocab)
    tokens: list[int]  # greedy continuation
    margin: float  # thinnest top-1/top-2 logit margin over the greedy steps


# ------------------------------------------------------------------------------- cases


def user(*parts: str | None) -> list[dict]:
    """One user turn whose content lists ``parts`` in order: None is an image, a string
    a text part."""
    return [{"role": "user", "content": [
        {"type": "image"} if part is None else {"type": "text", "text": part} for part in parts
    ]}]


def standard_cases(
    image_a,
    image_b,
    other_image,
    *,
    text: str = "Tell me a story about a red cat.",
    two_images: tuple[str | None, ...] = (None, None, "Compare the two images."),
) -> tuple[dict, dict]:
    """``(CASES, ALL_CASES)``: the parity cases every multi-turn family runs — text only,
    one image (``image_a``), two images of different sizes (``image_a``, ``image_b``;
    ``two_images`` gives the parts of that turn) and ``image_b`` in a later turn — and,
    in ``ALL_CASES`` only, ``one_other_image``: the one-image prompt with ``other_image``
    (``image_a``'s size, other content), the guard that the image matters."""
    cases = {
        "text": ([{"role": "user", "content": text}], []),
        "one_image": (user(None, "Describe this image."), [image_a]),
        "two_images": (user(*two_images), [image_a, image_b]),
        "image_in_second_turn": (
            [
                {"role": "user", "content": "Hello! Who are you?"},
                {"role": "assistant", "content": "I am a helpful assistant."},
                *user(None, "What is in this picture?"),
            ],
            [image_b],
        ),
    }
    return cases, with_other_image(cases, other_image)


def with_other_image(cases: dict, other_image) -> dict:
    """``cases`` and ``one_other_image``: the one-image prompt with another image."""
    return {**cases, "one_other_image": (cases["one_image"][0], [other_image])}


def read_config(tiny_checkpoints, family: str, layout: str) -> dict:
    return json.loads((tiny_checkpoints.path(family, layout) / "config.json").read_text())


def model_args_in_both_layouts(tiny_checkpoints, family: str) -> tuple:
    """``(hub, transformers)``: the arguments ``Model.from_config`` builds the family's
    model from, read from each config layout of its tiny checkpoint."""
    Model = get_family(family).Model
    return tuple(Model.from_config(read_config(tiny_checkpoints, family, layout)).args
                 for layout in ("hub", "transformers"))


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    """(family, layout) -> (model, processor) through mlxvlm.load, each loaded once."""
    return functools.cache(lambda family, layout: load(tiny_checkpoints.path(family, layout)))


def reference_fixture(processor=None):
    """A module-scoped ``reference`` fixture: (family, case) -> ``Reference`` for a case of
    the test module's ``ALL_CASES``, run on the in-memory transformers model.

    ``processor(tiny)`` builds the reference's processor from the tiny model's parts; by
    default it is the one mlxvlm builds."""

    @pytest.fixture(scope="module")
    def reference(request, tiny_checkpoints, loaded):
        cases = request.module.ALL_CASES

        @functools.cache
        def run(family: str, case: str) -> Reference:
            messages, images = cases[case]
            tiny = tiny_checkpoints.model(family)
            reference_processor = (
                processor(tiny) if processor is not None else loaded(family, "transformers")[1]
            )
            return reference_run(tiny.model, reference_processor, messages, images)

        return run

    return reference


reference = reference_fixture()


# ----------------------------------------------------------------- transformers' side


def with_images(messages: list[dict], images) -> list[dict]:
    """``messages`` with each image part holding its image (in order), as transformers'
    chat-template path takes them."""
    images = iter(images)

    def fill(content):
        if isinstance(content, str):
            return content
        return [{**part, "image": next(images)} if part.get("type") == "image" else part
                for part in content]

    return [{**message, "content": fill(message["content"])} for message in messages]


def processor_inputs(processor, messages, images, return_tensors: str = "pt", **template):
    """The processor's inputs for a chat, exactly as transformers builds them:
    ``apply_chat_template(tokenize=True)``, which also decides the special tokens (the
    tokenizer's, unless the rendered prompt starts with its BOS) and passes the images
    nested per conversation; ``template``: the chat template's variables."""
    return processor.apply_chat_template(
        with_images(messages, images), add_generation_prompt=True, tokenize=True,
        return_dict=True, return_tensors=return_tensors, **template,
    )


def transformers_logits(model, processor, messages, images) -> np.ndarray:
    """A transformers model's logits of one forward pass over the prompt."""
    import torch

    with torch.no_grad():
        return model(**processor_inputs(processor, messages, images)).logits[0].numpy()


def load_transformers_model(path: Path):
    """A checkpoint directory as transformers reads it, in float32."""
    import torch
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def reference_run(model, processor, messages, images, new_tokens: int = NEW_TOKENS,
                  **template) -> Reference:
    import torch

    inputs = processor_inputs(processor, messages, images, **template)
    with torch.no_grad():
        logits = model(**inputs).logits[0].numpy()
        out = model.generate(
            **inputs, max_new_tokens=new_tokens, do_sample=False,
            output_scores=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return Reference(inputs["input_ids"][0].tolist(), logits, tokens, min(margins))


def reference_forward(model, processor, messages, images, continuation: list[int]) -> np.ndarray:
    """transformers' logits over the prompt followed by ``continuation``, in one forward
    pass: what the decode steps must reproduce one token at a time."""
    import torch

    inputs = processor_inputs(processor, messages, images)
    length = inputs["input_ids"].shape[1]
    extra = torch.tensor([continuation])
    for key, value in list(inputs.items()):
        if value.ndim == 2 and value.shape[1] == length:  # per-token: ids, masks, types
            fill = {"input_ids": extra, "attention_mask": torch.ones_like(extra)}.get(
                key, torch.zeros_like(extra)
            )
            inputs[key] = torch.cat([value, fill], dim=1)
    with torch.no_grad():
        return model(**inputs).logits[0].numpy()


# --------------------------------------------------------------------------- our side


def parameter_list(model) -> list[tuple[str, mx.array]]:
    """Every weight of a loaded model, the tables it gathers from disk included."""
    params = [(k, v) for k, v in tree_flatten(model.parameters()) if isinstance(v, mx.array)]
    modules = dict(model.named_modules()) if getattr(model, "tables_on_disk", ()) else {}
    for path in getattr(model, "tables_on_disk", ()):
        params += [(f"{path}.{k}", v) for k, v in modules[path].stored_tensors().items()]
    return params


def embedded(model, processor, messages, images):
    """``(input_ids, embeddings, state)`` of a chat: what the generate loop prefills."""
    inputs = prepare_inputs(processor, messages, images, feature_names=model.feature_names)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    return inputs.input_ids, embeddings, state


def first_pass(model, input_ids, embeddings, state) -> np.ndarray:
    """Logits of one forward pass over the whole prompt, with a fresh cache."""
    return np.array(model(input_ids, model.make_cache(), embeddings=embeddings, state=state)[0])


def our_logits(model, processor, messages, images) -> tuple[list[int], np.ndarray]:
    """Prompt ids and the logits of one forward pass over the whole prompt."""
    input_ids, embeddings, state = embedded(model, processor, messages, images)
    return input_ids[0].tolist(), first_pass(model, input_ids, embeddings, state)


def our_decode_logits(model, processor, messages, images, continuation: list[int], cache=None) -> np.ndarray:
    """Logits for the prompt's last token, then for each token of ``continuation`` fed one
    at a time through the cache (the decode path): (1 + len(continuation), vocab)."""
    input_ids, embeddings, state = embedded(model, processor, messages, images)
    cache = model.make_cache() if cache is None else cache
    steps = [model(input_ids, cache, embeddings=embeddings, state=state)[0, -1]]
    for token in continuation:
        steps.append(model(mx.array([[token]]), cache, state=state)[0, -1])
    return np.array(mx.stack(steps))


def our_tokens(model, processor, messages, images, max_tokens: int = NEW_TOKENS, **options) -> list[int]:
    """Greedy tokens through ``mlxvlm.stream_generate``."""
    results = stream_generate(
        model, processor, messages, image=images, max_tokens=max_tokens, temperature=0.0, **options
    )
    return [r.token for r in results]


def save_as_mlx_checkpoint(model, source: Path, target: Path) -> Path:
    """``source``'s config and processor files with ``model``'s parameters in our names,
    marked as MLX tools mark them (``{"format": "mlx"}``), as mlx-community publishes."""
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.suffix != ".safetensors":
            shutil.copyfile(item, target / item.name)
    mx.save_safetensors(str(target / "model.safetensors"), dict(parameter_list(model)),
                        metadata={"format": "mlx"})
    return target


# ------------------------------------------------------------------------ assertions


def assert_first_pass_matches(model, processor, case, ref: Reference,
                              atol: float = LOGITS_ATOL) -> list[int]:
    """Our prompt ids are the reference's and our first-pass logits within ``atol``;
    returns the ids."""
    ids, logits = our_logits(model, processor, *case)
    assert ids == ref.input_ids, "the processor built by mlxvlm tokenized the prompt differently"
    np.testing.assert_allclose(logits, ref.logits, rtol=0, atol=atol)
    return ids


def assert_reference_is_decisive(ref: Reference) -> None:
    """The reference ran all NEW_TOKENS steps and no greedy step was a near tie, so that
    equal tokens mean equal maths rather than luck with rounding."""
    assert len(ref.tokens) == NEW_TOKENS, "the reference stopped early; pick another prompt"
    assert ref.margin > MIN_REFERENCE_MARGIN, f"top-1/top-2 margin {ref.margin:.2e} is too thin"


def assert_greedy_tokens_match(model, processor, case, ref: Reference, **options) -> None:
    """A decisive reference, and our greedy tokens (``options`` to stream_generate) equal."""
    assert_reference_is_decisive(ref)
    assert our_tokens(model, processor, *case, **options) == ref.tokens


def assert_decode_steps_match(reference_model, model, processor, case, ref: Reference) -> None:
    """Teacher-forced on the reference's answer, every decode step gives the logits
    transformers computes for it in one pass."""
    messages, images = case
    expected = reference_forward(reference_model, processor, messages, images, ref.tokens)
    steps = our_decode_logits(model, processor, messages, images, ref.tokens)
    np.testing.assert_allclose(steps, expected[len(ref.input_ids) - 1 :], rtol=0, atol=LOGITS_ATOL)


def assert_batched_tokens_match(model, processor, cases: dict, references: list[Reference]) -> None:
    """The batching engine decodes the prompts of ``cases`` together; each still gets its
    reference's greedy tokens."""
    outputs = batch_generate(model, processor, [messages for messages, _ in cases.values()],
                             [images or None for _, images in cases.values()],
                             max_tokens=NEW_TOKENS, temperature=0.0)
    assert [o.tokens for o in outputs] == [ref.tokens for ref in references]


def assert_rotating_cache_keeps_the_prompt(model, processor, case, ref: Reference) -> None:
    """With a rotating cache (``max_kv_size``) that evicts nothing for half the answer,
    generation runs to the end and the first half is the reference's."""
    max_kv_size = len(ref.input_ids) + NEW_TOKENS // 2
    tokens = our_tokens(model, processor, *case, max_kv_size=max_kv_size)
    assert len(tokens) == NEW_TOKENS
    assert tokens[: NEW_TOKENS // 2] == ref.tokens[: NEW_TOKENS // 2]


def assert_another_image_changes_the_output(model, processor, all_cases: dict, family: str, reference) -> None:
    """The guard that the image matters: ``one_other_image``'s tokens differ from
    ``one_image``'s, and are still the reference's own."""
    other = our_tokens(model, processor, *all_cases["one_other_image"])
    assert other != reference(family, "one_image").tokens
    assert other == reference(family, "one_other_image").tokens


def assert_wrong_model_is_caught(wrong, model, processor, case, ref: Reference) -> None:
    """``wrong`` (built from a deliberately changed config) with ``model``'s weights gives
    logits far from the reference's: the parity tests would catch that change."""
    wrong.load_weights(parameter_list(model))
    _, logits = our_logits(wrong, processor, *case)
    assert np.abs(logits - ref.logits).max() > CAUGHT


def standard_parity_tests(family_layouts: list[tuple[str, str]], cases: dict,
                          logits_atol: dict[str, float] | None = None):
    """The two parity tests every family runs, parametrized over ``family_layouts`` x the
    cases: first-pass logits and greedy tokens against the module's ``reference``. A test
    module assigns them under their own names so that pytest collects them there (with its
    fixtures)::

        test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
            standard_parity_tests(FAMILY_LAYOUTS, CASES)
        )

    ``logits_atol``: a case's own tolerance where a family's towers spread further than
    LOGITS_ATOL in float32 (the test module says why).
    """
    logits_atol = logits_atol or {}

    @pytest.mark.parametrize("case", list(cases))
    @pytest.mark.parametrize("family,layout", family_layouts)
    def test_first_pass_logits_match_transformers(family, layout, case, loaded, reference):
        model, processor = loaded(family, layout)
        assert_first_pass_matches(model, processor, cases[case], reference(family, case),
                                  atol=logits_atol.get(case, LOGITS_ATOL))

    @pytest.mark.parametrize("case", list(cases))
    @pytest.mark.parametrize("family,layout", family_layouts)
    def test_greedy_tokens_match_transformers(family, layout, case, loaded, reference):
        model, processor = loaded(family, layout)
        assert_greedy_tokens_match(model, processor, cases[case], reference(family, case))

    return test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers


def assert_patch_weight_is_channels_last(weights: dict, name: str, vision) -> None:
    """A PyTorch (out, in, kh, kw) patch convolution was moved to MLX's (out, kh, kw, in)."""
    assert weights[name].shape == (
        vision.hidden_size, vision.patch_size, vision.patch_size, vision.num_channels
    )


def first_logits_and_greedy_tokens(model, processor, prompt: str, image, max_tokens: int):
    """The first forward pass's logits (numpy) and the greedy tokens ``generate`` gives:
    what a fast path must leave unchanged (tests of the CPU fast paths and kernels)."""
    inputs = prepare_inputs(processor, prompt, image, feature_names=model.feature_names)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    logits = model(inputs.input_ids, model.make_cache(), embeddings=embeddings, state=state)
    # temperature 0: greedy even where generation_config.json samples (GLM-4.6V's, InternVL's)
    tokens = generate(model, processor, prompt, image, max_tokens=max_tokens,
                      temperature=0.0).tokens
    return np.array(logits[0]), tokens
