"""The family contract (models/base.py): what a family gets without writing it, and what
every registered family's ``Model`` provides, so that the loader can reach any family
through its class alone."""

from __future__ import annotations

import ast
import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path

import mlx.nn as nn
import pytest

from mlxvlm.models import FAMILIES, get_family
from mlxvlm.models.base import VisionLanguageModel

MODELS_DIR = Path(__file__).resolve().parents[1] / "mlxvlm" / "models"


# ------------------------------------------------------------------ a minimal family


@dataclass
class TinyText:
    max_position_embeddings: int = 77


@dataclass
class TinyArgs:
    text: TinyText = field(default_factory=TinyText)
    image_token_id: int = 5
    video_token_id: int | None = None
    audio_token_id: int = 9
    width: int = 4

    @classmethod
    def from_hf(cls, config: dict) -> "TinyArgs":
        return cls(width=config["hidden_size"], image_token_id=config["image_token_id"])


class TinyDecoder(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.layers = [nn.Linear(width, width), nn.Linear(width, width)]


class TinyLanguageModel(nn.Module):
    """mlx-community's ``language_model.model.*`` naming: the blocks one level down."""

    def __init__(self, width: int):
        super().__init__()
        self.model = TinyDecoder(width)
        self.lm_head = nn.Linear(width, 3)


class TinyModel(VisionLanguageModel):
    """Only what is specific to a family: its modules and its tables."""

    args_class = TinyArgs
    hf_prefixes = (
        ("model.language_model.", "language_model.model."),
        ("model.", "language_model.model."),
        ("model.visual.", "vision_tower."),
        ("lm_head.", "language_model.lm_head."),
    )

    def __init__(self, args: TinyArgs):
        super().__init__()
        self.args = args
        self.vision_tower = nn.Linear(args.width, args.width)
        self.language_model = TinyLanguageModel(args.width)

    def sanitize(self, weights):
        return {self.hf_to_mlx_name(name): value for name, value in weights.items()}


def test_a_minimal_family_is_built_by_the_default_from_config():
    model = TinyModel.from_config({"hidden_size": 6, "image_token_id": 11})
    assert isinstance(model, TinyModel)
    assert model.args.width == 6
    assert model.vision_tower.weight.shape == (6, 6)


def test_a_minimal_family_gets_the_decoder_defaults():
    model = TinyModel(TinyArgs())
    assert model.layers is model.language_model.model.layers
    assert len(model.make_cache()) == 2
    assert model.max_context == 77
    # None fields (no video token) are not placeholders
    assert model.placeholder_token_ids == {5, 9}


def test_layers_default_reads_a_decoder_without_the_model_level():
    class Flat(TinyModel):
        def __init__(self, args):
            super().__init__(args)
            self.language_model = TinyDecoder(args.width)

    model = Flat(TinyArgs())
    assert model.layers is model.language_model.layers


def test_defaults_without_args_say_nothing_is_known():
    class Bare(VisionLanguageModel):
        pass

    model = Bare()
    assert model.max_context is None
    assert model.placeholder_token_ids == set()
    with pytest.raises(NotImplementedError, match="args_class"):
        Bare.from_config({})
    with pytest.raises(NotImplementedError, match="processor_class"):
        Bare.load_processor("/nowhere", {})
    assert not Bare.is_hf_checkpoint(["model.layers.0.weight"])  # no table: ours


def test_name_mapping_takes_the_longest_hugging_face_prefix():
    # "model." comes first in the table, but the longer "model.visual." decides
    assert TinyModel.hf_to_mlx_name("model.visual.proj.weight") == "vision_tower.proj.weight"
    assert TinyModel.hf_to_mlx_name("model.language_model.norm.weight") == "language_model.model.norm.weight"
    assert TinyModel.hf_to_mlx_name("model.norm.weight") == "language_model.model.norm.weight"
    assert TinyModel.hf_to_mlx_name("vision_tower.proj.weight") == "vision_tower.proj.weight"


def test_default_is_hf_checkpoint_reads_the_table():
    assert TinyModel.is_hf_checkpoint(["model.visual.weight", "lm_head.weight"])
    assert not TinyModel.is_hf_checkpoint(["vision_tower.weight", "language_model.lm_head.weight"])
    # a generator is read once, whole
    assert TinyModel.is_hf_checkpoint(n for n in ["vision_tower.weight", "lm_head.weight"])


def test_mlx_prefixes_refuse_a_checkpoint_in_both_namings():
    class Strict(TinyModel):
        mlx_prefixes = ("vision_tower.", "language_model.")

    assert Strict.is_hf_checkpoint(["model.visual.weight"])
    assert not Strict.is_hf_checkpoint(["vision_tower.weight"])
    with pytest.raises(ValueError, match="neither layout"):
        Strict.is_hf_checkpoint(["model.visual.weight", "vision_tower.weight"])
    # without mlx_prefixes a mixed checkpoint is taken for Hugging Face's
    assert TinyModel.is_hf_checkpoint(["model.visual.weight", "vision_tower.weight"])


def test_hf_module_name_inverts_the_table_through_sanitize():
    model = TinyModel(TinyArgs())
    # the first Hugging Face prefix listed for our language model: the module tree
    assert model.hf_module_name("language_model.model.layers.0") == "model.language_model.layers.0"
    assert model.hf_module_name("vision_tower.proj") == "model.visual.proj"
    with pytest.raises(NotImplementedError, match="hf_prefixes"):
        model.hf_module_name("elsewhere.proj")


def test_the_default_processor_is_the_named_transformers_classes(monkeypatch):
    import transformers

    built = {}

    class FakeTokenizer:
        @classmethod
        def from_pretrained(cls, path):
            return ("tokenizer", path)

    class FakeImageProcessor:
        @classmethod
        def from_pretrained(cls, path):
            return ("image processor", path)

    class FakeProcessor:
        @classmethod
        def from_pretrained(cls, path, **parts):
            built.update(parts, path=path)
            return "processor"

    monkeypatch.setattr(transformers, "AutoTokenizer", FakeTokenizer)
    monkeypatch.setattr(transformers, "FakeImageProcessorPil", FakeImageProcessor, raising=False)
    monkeypatch.setattr(transformers, "FakeProcessor", FakeProcessor, raising=False)

    class WithProcessor(TinyModel):
        processor_class = "FakeProcessor"
        image_processor_class = "FakeImageProcessorPil"

    assert WithProcessor.load_processor("/ckpt", {}) == "processor"
    assert built == {
        "path": "/ckpt",
        "tokenizer": ("tokenizer", "/ckpt"),
        "image_processor": ("image processor", "/ckpt"),
    }


# -------------------------------------------------------------- every registered family


FAMILY_MODULES = sorted(set(FAMILIES.values()))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_model_satisfies_the_contract(model_type):
    module = get_family(model_type)
    Model = module.Model
    assert issubclass(Model, VisionLanguageModel)
    # the loader's entry points are class-level: callable before any model exists
    for name in ("from_config", "is_hf_checkpoint", "hf_to_mlx_name", "load_processor"):
        assert inspect.ismethod(getattr(Model, name)), name
    assert Model.hf_prefixes, "a family maps Hugging Face names onto its own"
    for pair in Model.hf_prefixes:
        hf, ours = pair
        # every entry renames its own prefix as listed: a shorter one listed first
        # (transformers' module tree) does not shadow it
        assert Model.hf_to_mlx_name(hf + "x") == ours + "x", pair
    assert Model.feature_names and all(isinstance(n, str) for n in Model.feature_names)
    # the module's names for outside callers are the class's
    assert module.is_hf_checkpoint == Model.is_hf_checkpoint
    assert module.load_processor == Model.load_processor


@pytest.mark.parametrize("module_name", FAMILY_MODULES)
def test_family_names_transformers_names_as_hugging_face_ones(module_name):
    Model = importlib.import_module(f"mlxvlm.models.{module_name}").Model
    # transformers' module tree of every family starts at model. (or thinker. for Omni;
    # the retrieval models' at vlm., their backbone)
    hf_names = [hf + "weight" for hf, _ in Model.hf_prefixes
                if hf.startswith(("model.", "vlm."))]
    assert hf_names and Model.is_hf_checkpoint(hf_names)


def test_family_files_hold_no_contract_boilerplate():
    """The properties and from_config every family used to repeat are the base class's."""
    repeated = {"layers", "placeholder_token_ids"}
    for path in MODELS_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Model":
                defined = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                assert not defined & repeated, (path.name, defined & repeated)


# Mixins that only declare what a family requires, adding no behaviour of their own:
# RequiresExperts refuses a MoE family's config without experts before the family builds.
REQUIREMENT_MIXINS = {"RequiresExperts"}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_chains_are_at_most_family_then_one_variant(model_type):
    """A family's Model sits on the contract, on one shared family base, or (a variant:
    an MoE decoder, another tower) one level above that: at most two of mlxvlm's own
    classes between it and VisionLanguageModel, so a reader follows imports, not floors
    of overrides."""
    Model = get_family(model_type).Model
    mro = Model.__mro__
    between = [
        cls for cls in mro[1:mro.index(VisionLanguageModel)]
        if cls.__module__.startswith("mlxvlm.") and cls.__name__ not in REQUIREMENT_MIXINS
    ]
    names = [f"{c.__module__}.{c.__qualname__}" for c in between]
    assert len(between) <= 2, names
    # A variant sits on one family; a family sits on a shared base, never on another
    # family (Qwen3-VL on Qwen2-VL made every Qwen model a floor of overrides).
    family_models = {get_family(t).Model for t in FAMILIES}
    assert sum(cls in family_models for cls in between) <= 1, names


# ------------------------------------------------------------------ import direction


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, at module level) for every import in ``path``, with
    ``from mlxvlm.models import x`` read as ``mlxvlm.models.x``."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, id(node) in top))
            found += [(f"{node.module}.{alias.name}", id(node) in top) for alias in node.names]
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(MODELS_DIR.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODEL_FILES = sorted(MODELS_DIR.rglob("*.py"))
# What the models package may import from the rest of mlxvlm: the layers below it.
# The CPU backend only through its door (mlxvlm.cpu.ops); the shard plan's type (the
# base class's ``sharding``); the retrieval use's (the base class's ``retrieval``, a
# module of the same floor that imports no family).
BELOW_MODELS = ("mlxvlm.errors", "mlxvlm.cpu.ops", "mlxvlm.distributed.group",
                "mlxvlm.retrieval.use")


def test_models_import_nothing_from_above_them():
    for path in MODEL_FILES:
        for name, _ in _imports(path):
            if name.startswith("mlxvlm.") and not name.startswith("mlxvlm.models"):
                assert name.startswith(BELOW_MODELS), (path.name, name)


def test_models_have_no_import_cycles():
    known = {_module_name(p) for p in MODEL_FILES}
    graph = {
        _module_name(p): {n for n, top in _imports(p) if top and n in known and n != _module_name(p)}
        for p in MODEL_FILES
    }
    done, visiting = set(), []

    def visit(module):
        if module in visiting:
            cycle = visiting[visiting.index(module):] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        visiting.append(module)
        for dependency in sorted(graph[module]):
            visit(dependency)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_no_family_reaches_into_another_familys_private_names():
    families = {f"mlxvlm.models.{m}" for m in FAMILY_MODULES}
    for path in MODELS_DIR.glob("*.py"):
        source = path.read_text()
        for family in families:
            short = family.rsplit(".", 1)[-1]
            assert f"{short}._" not in source.replace(f"{short}.__", ""), (path.name, short)
