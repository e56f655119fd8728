"""What every parity test against transformers shares: tolerances, the loaded-model and
reference fixtures, and our side's logits and greedy tokens.

A test module defines ``ALL_CASES``: case name -> (chat messages, images). Import the
fixtures into it (``from parity import loaded, reference``) to use them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxvlm import load, stream_generate
from mlxvlm.prompt import prepare_inputs

LOGITS_ATOL = 1e-4
NEW_TOKENS = 24
# Greedy parity is meaningful only if float32 rounding cannot flip a token.
MIN_REFERENCE_MARGIN = 1e-3


class Reference(NamedTuple):
    """transformers' side of a case."""

    input_ids: list[int]
    logits: np.ndarray  # first forward pass, (prompt_length, vocab)
    tokens: list[int]  # greedy continuation
    margin: float  # thinnest top-1/top-2 logit margin over the greedy steps


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    """(family, layout) -> (model, processor) through mlxvlm.load, each loaded once."""
    return functools.cache(lambda family, layout: load(tiny_checkpoints.path(family, layout)))


@pytest.fixture(scope="module")
def reference(request, tiny_checkpoints, loaded):
    """(family, case) -> ``Reference`` for a case of the test module's ``ALL_CASES``, run
    on the in-memory transformers model with the processor mlxvlm builds."""
    cases = request.module.ALL_CASES

    @functools.cache
    def run(family: str, case: str) -> Reference:
        messages, images = cases[case]
        _, processor = loaded(family, "transformers")
        return reference_run(tiny_checkpoints.model(family).model, processor, messages, images)

    return run


def reference_run(model, processor, messages, images, new_tokens: int = NEW_TOKENS) -> Reference:
    import torch

    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=list(images) or None, return_tensors="pt")
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

    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=list(images) or None, return_tensors="pt")
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


def parameter_list(model) -> list[tuple[str, mx.array]]:
    return [(k, v) for k, v in tree_flatten(model.parameters()) if isinstance(v, mx.array)]


def our_logits(model, processor, messages, images) -> tuple[list[int], np.ndarray]:
    """Prompt ids and the logits of one forward pass over the whole prompt."""
    inputs = prepare_inputs(processor, messages, images, feature_names=model.feature_names)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    logits = model(inputs.input_ids, model.make_cache(), embeddings=embeddings, state=state)
    return inputs.input_ids[0].tolist(), np.array(logits[0])


def our_decode_logits(model, processor, messages, images, continuation: list[int], cache=None) -> np.ndarray:
    """Logits for the prompt's last token, then for each token of ``continuation`` fed one
    at a time through the cache (the decode path): (1 + len(continuation), vocab)."""
    inputs = prepare_inputs(processor, messages, images, feature_names=model.feature_names)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    cache = model.make_cache() if cache is None else cache
    steps = [model(inputs.input_ids, cache, embeddings=embeddings, state=state)[0, -1]]
    for token in continuation:
        steps.append(model(mx.array([[token]]), cache, state=state)[0, -1])
    return np.array(mx.stack(steps))


def our_tokens(model, processor, messages, images, max_tokens: int = NEW_TOKENS, **options) -> list[int]:
    """Greedy tokens through ``mlxvlm.stream_generate``."""
    results = stream_generate(
        model, processor, messages, image=images, max_tokens=max_tokens, temperature=0.0, **options
    )
    return [r.token for r in results]
