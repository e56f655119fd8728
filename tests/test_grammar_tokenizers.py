"""llguidance's view of a tokenizer (``constrained.grammar_tokenizer``: the grammar
tokenizer and its closing preference, tens of MB for a large vocabulary) lives as long as
the transformers tokenizer it was built from, no longer (issue 39, item 8): once a server
unloads a model that served structured output, its tokenizer and these go, and they are
built once per tokenizer while it lives."""

from __future__ import annotations

import gc
import json
import weakref

from server_harness import LiveServer, wait_until
from test_server_models import A, B, HELLO, paths, registry  # noqa: F401  (the fixture)
from tiny.qwen import build_tokenizer

import mlxvlm
from mlxvlm.sampling import constrained


def collected(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is None


def test_built_once_per_tokenizer_and_gone_with_it():
    tokenizer = build_tokenizer()
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    first = constrained.grammar_tokenizer(tokenizer, eos)
    assert constrained.grammar_tokenizer(tokenizer, eos) is first
    assert constrained.grammar_tokenizer(tokenizer, []) is not first  # other end ids
    constraint = constrained.json_schema_constraint(tokenizer, eos, None)
    constraint.check_budget(16)  # builds the closing preference too
    kept = weakref.ref(first), weakref.ref(tokenizer)
    del tokenizer, first, constraint
    assert all(collected(ref) for ref in kept)


def test_an_unloaded_model_takes_its_grammar_tokenizer_along(paths):  # noqa: F811
    tokenizers = {}

    def loader(model_id: str, path: str):
        model, processor = mlxvlm.load(path)
        tokenizers[model_id] = weakref.ref(processor.tokenizer)
        return model, processor

    models = registry(paths, loader, max_loaded_models=1)
    with LiveServer(None, None, registry=models) as server:
        client = server.client()
        answer = client.chat.completions.create(
            model=A, messages=HELLO, max_tokens=24, response_format={"type": "json_object"})
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
        built = weakref.ref(next(iter(constrained._GRAMMAR_TOKENIZERS[tokenizers[A]()].values())))
        client.chat.completions.create(model=B, messages=HELLO, max_tokens=4)
        assert models.loaded_ids() == [B]
        assert wait_until(lambda: collected(tokenizers[A]) and collected(built), timeout=30)
