"""State on objects mlxvlm does not own (issue 40): what loading learns about transformers'
processor lives in one typed ``ProcessorState`` (text/tokenization.py), what it sets on the
model is declared on ``VisionLanguageModel``; no module guesses with getattr defaults."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from transformers import AutoTokenizer, GenerationConfig

import mlxvlm
from mlxvlm import load
from mlxvlm.checkpoint.loading import read_config
from mlxvlm.models import get_family
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.sampling.defaults import NO_CHECKPOINT_DEFAULTS
from mlxvlm.text.tokenization import (STATE_ATTRIBUTE, ProcessorState, generation_tokenizer,
                                      processor_state, tokenizer_of)

PACKAGE = Path(mlxvlm.__file__).parent
FAMILY = "qwen2_vl"


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    path = tiny_checkpoints.path(FAMILY, "hub")
    return path, *load(path)


def test_load_keeps_its_findings_in_one_typed_state(loaded):
    path, model, processor = loaded
    bare = get_family(FAMILY).Model.load_processor(path, read_config(path))
    # What load added to transformers' processor: the state, and the documented alias.
    assert set(vars(processor)) - set(vars(bare)) == {STATE_ATTRIBUTE, "sampling_defaults"}
    state = processor_state(processor)
    assert isinstance(state, ProcessorState)
    assert state.tokenizer is processor.tokenizer
    assert isinstance(state.generation_tokenizer, TokenizerWrapper)
    assert generation_tokenizer(processor) is state.generation_tokenizer
    assert processor.sampling_defaults is state.sampling_defaults
    # Every end-of-sequence id, from transformers' own readers of the checkpoint's files.
    config = json.loads((path / "config.json").read_text())
    expected = set()
    for ids in (config.get("eos_token_id"), config.get("text_config", {}).get("eos_token_id"),
                GenerationConfig.from_pretrained(path).eos_token_id,
                AutoTokenizer.from_pretrained(path).eos_token_id):
        expected |= set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    assert state.eos_token_ids == expected
    assert set(state.generation_tokenizer.eos_token_ids) == expected


def test_model_attributes_are_declared_on_the_base_class(loaded):
    _, model, _ = loaded
    assert model.sharding is None  # one process: the whole model
    assert model.cpu_fast_paths is not None  # load's report (off, or what it did)
    assert model.retrieval is None  # a chat model
    for name in ("sharding", "cpu_fast_paths", "retrieval"):
        assert name in VisionLanguageModel.__annotations__
        assert getattr(VisionLanguageModel, name) is None


def test_tokenizer_of_a_processor_and_of_a_bare_tokenizer(loaded):
    _, _, processor = loaded
    tokenizer = processor.tokenizer
    assert tokenizer_of(processor) is tokenizer
    assert tokenizer_of(tokenizer) is tokenizer
    wrapper = TokenizerWrapper(tokenizer)  # what mlx-lm's load gives a draft model
    assert tokenizer_of(wrapper) is wrapper
    with pytest.raises(AttributeError):
        tokenizer_of(object())  # neither: an error, not a guess


def test_a_processor_built_by_hand_gets_its_state_on_first_use(loaded):
    _, _, processor = loaded
    hand_built = SimpleNamespace(tokenizer=processor.tokenizer)
    state = processor_state(hand_built)
    assert processor_state(hand_built) is state  # made once
    assert state.tokenizer is processor.tokenizer
    assert state.eos_token_ids == {processor.tokenizer.eos_token_id}
    assert state.sampling_defaults is NO_CHECKPOINT_DEFAULTS


# Attributes mlxvlm owns the home of: read them from it, never guess with getattr/hasattr.
OWNED = {"tokenizer", "sharding", "cpu_fast_paths", "retrieval", "eos_token_ids",
         "detokenizer_tokenizer",
         "sampling_defaults", STATE_ATTRIBUTE}
# The one reader of the processor's state attribute.
STATE_READER = PACKAGE / "text" / "tokenization.py"


def _guesses(source: str, where: str, reads_state: bool = False) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in OWNED):
            if not (reads_state and node.args[1].value == STATE_ATTRIBUTE):
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_guesses_at_state_it_has_a_home_for():
    found = [g for path in sorted(PACKAGE.rglob("*.py"))
             for g in _guesses(path.read_text(), str(path.relative_to(PACKAGE)),
                               reads_state=path == STATE_READER)]
    assert found == []


def test_the_guess_finder_finds_the_guesses_it_replaced():
    source = ('tokenizer = getattr(processor, "tokenizer", processor)\n'
              'plan = getattr(model, "sharding", None)\n'
              'state = getattr(processor, "mlxvlm_state", None)\n'
              'ok = getattr(tokenizer, "chat_template", None)\n')
    assert [g.split(" ", 1)[0] for g in _guesses(source, "m")] == ["m:1", "m:2", "m:3"]
    assert [g.split(" ", 1)[0] for g in _guesses(source, "m", reads_state=True)] == ["m:1", "m:2"]
