"""Path or Hub repo -> (model, processor).

The loader reads ``config.json``, picks the family from the registry, builds the module tree,
loads the safetensors weights (mapping Hugging Face names onto ours only for Hugging Face
checkpoints), applies the checkpoint's quantization, and builds the processor.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.errors import CheckpointError, ModelNotFoundError
from mlxvlm.models import get_family
from mlxvlm.models.base import materialize
from mlxvlm.checkpoint.output_head import settle_absent_head
from mlxvlm.checkpoint.quantization import apply_quantization

# Files a checkpoint needs; code files only with trust_remote_code.
_ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "tokenizer*",
    "spk_dict.pt",  # Qwen2.5-Omni's voices
]

# Written into config.json by `mlxvlm.convert`: the weights are already in MLX layout.
CONVERTED_MARKER = "mlxvlm_format"


def resolve_model_path(
    path_or_repo: str | Path, revision: str | None = None, trust_remote_code: bool = False,
    weight_files: list[str] | None = None,
) -> Path:
    """A local directory as is, or a Hub repo id downloaded (or found in the HF cache):
    every safetensors file, or only ``weight_files`` (a sharded rank's, see
    ``shard_files``) with the configs and tokenizer."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path} is a file; pass the checkpoint's directory")
    repo = str(path_or_repo)
    looks_local = repo.startswith((".", "/", "~")) or repo.count("/") > 1
    if looks_local:
        raise ModelNotFoundError(f"model directory {repo!r} does not exist{_did_you_mean(repo)}")

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    patterns = _ALLOW_PATTERNS + (["*.py"] if trust_remote_code else [])
    if weight_files is not None:
        patterns = [p for p in patterns if p != "*.safetensors"] + list(weight_files)
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise ModelNotFoundError(
            f"{repo} is gated: accept its licence on the Hub and log in with `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"no local directory or Hub repo named {repo!r} (check the spelling; private "
            "repos need `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{repo} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(_not_local_nor_cached(repo)) from None
    except HFValidationError:
        raise ModelNotFoundError(
            f"{repo!r} is neither a local directory nor a valid Hub repo id"
        ) from None


def _download_shard(repo: str, revision: str | None, trust_remote_code: bool,
                    sharding: tuple[mx.distributed.Group, str]) -> Path:
    """A sharded rank's download of a Hub repo: the configs and tokenizer, then only the
    safetensors files holding a tensor the rank keeps (``shard_files``). Where the Hub
    cannot tell the files' tensors (offline, a cached repo), every file, as one process."""
    from mlxvlm.checkpoint import shard_files

    model_path = resolve_model_path(repo, revision, trust_remote_code, weight_files=[])
    config = read_config(model_path)
    try:
        files = shard_files.hub_files(repo, revision)
    except Exception:  # noqa: BLE001  (offline or no headers: the whole checkpoint)
        return resolve_model_path(repo, revision, trust_remote_code)
    converted = converted_by(config, [fmt for fmt, _ in files.values()])
    needed = shard_files.files_for_rank(files, config, get_family(config.get("model_type")),
                                        sharding, converted)
    return resolve_model_path(repo, revision, trust_remote_code, weight_files=needed)


def _not_local_nor_cached(repo: str) -> str:
    """A name that may be a mistyped path or a Hub repo not downloaded yet: the Hub
    cannot say which while offline, so the message names both."""
    from huggingface_hub import constants

    why = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
    return (f"{repo!r} is neither a local directory nor a Hub repo in the local Hugging Face "
            f"cache ({why}){_did_you_mean(repo)}")


def _did_you_mean(path_text: str) -> str:
    """``; did you mean DIR?`` for a directory beside the missing one with a close name."""
    import difflib

    path = Path(path_text).expanduser()
    try:
        siblings = [p.name for p in path.parent.iterdir() if p.is_dir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.75)
    return f"; did you mean {path.parent / close[0]}?" if close else ""


def read_config(model_path: Path) -> dict:
    config_file = model_path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{model_path} has no config.json; is it a model checkpoint?")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file} is not valid JSON: {exc}") from None


def weights_files(model_path: Path) -> list[Path]:
    files = sorted(Path(f) for f in glob.glob(str(model_path / "*.safetensors")))
    files = [f for f in files if not f.name.startswith("adapter")]
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_path}")
    return files


def read_weight_files(model_path: Path) -> dict[Path, dict[str, mx.array]]:
    """Each safetensors file's tensors, lazily loaded (read when first evaluated)."""
    return {file: mx.load(str(file)) for file in weights_files(model_path)}


def load_weights_files(model_path: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for arrays in read_weight_files(model_path).values():
        weights.update(arrays)
    return weights


def is_converted(model_path: Path, config: dict) -> bool:
    """Whether the weights are already in MLX layout, as their writer marked them:
    ``mlxvlm.convert`` in config.json, and every MLX tool (mlx-lm, mlx-vlm — so
    mlx-community's checkpoints — and mlxvlm.convert) with ``{"format": "mlx"}`` in the
    safetensors metadata, where transformers writes ``"pt"``. Names alone cannot tell: a
    float conversion of some families keeps the Hub's original names."""
    if config.get(CONVERTED_MARKER):
        return True
    from safetensors import safe_open

    formats = []
    for file in weights_files(model_path):
        with safe_open(str(file), framework="numpy") as f:
            formats.append((f.metadata() or {}).get("format"))
    return converted_by(config, formats)


def converted_by(config: dict, formats: list[str | None]) -> bool:
    """``is_converted`` from config.json and the weight files' ``format`` metadata."""
    return bool(config.get(CONVERTED_MARKER)) or all(f == "mlx" for f in formats)


def collect_eos_token_ids(model_path: Path, config: dict, tokenizer: Any) -> set[int]:
    """Every end-of-sequence id the checkpoint names: config, generation_config, tokenizer."""
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(config.get("eos_token_id"))
    add((config.get("text_config") or {}).get("eos_token_id"))
    generation_config = model_path / "generation_config.json"
    if generation_config.exists():
        add(json.loads(generation_config.read_text()).get("eos_token_id"))
    add(getattr(tokenizer, "eos_token_id", None))
    return ids


def compute_dtype_for_device(requested: mx.Dtype | None) -> mx.Dtype | None:
    """float16/bfloat16 matmuls are slower than float32 on MLX's CPU backend."""
    if requested is not None:
        return requested
    return mx.float32 if mx.default_device() == mx.cpu else None


def build_model(model_path: Path, config: dict, family, weights: dict[str, mx.array],
                sharding: tuple[mx.distributed.Group, str] | None = None,
                head_optional: bool = False) -> nn.Module:
    """``family``'s module tree for ``config`` holding ``weights`` (the checkpoint's at
    ``model_path``): mapped onto our names only if they are a Hugging Face checkpoint's
    (see ``is_converted``), quantized as the config says. Weights that do not fit the
    tree raise CheckpointError. Shared by ``load`` and ``mlxvlm.convert``.

    ``sharding`` (group, "tensor" or "pipeline"): this rank's shard of the language
    model only (``mlxvlm.distributed.sharding``), its weights still lazy; the plan is
    ``model.sharding``."""
    model = family.Model.from_config(config)
    # the model's own: a family may use parts of a checkpoint only when its config has them
    unused = model.unused_weight_prefixes
    if unused:
        weights = {name: value for name, value in weights.items() if not name.startswith(unused)}
    if not is_converted(model_path, config) and family.Model.is_hf_checkpoint(weights.keys()):
        weights = model.sanitize(weights)
    if hasattr(model, "drop_absent_parts"):  # optional parts the tensors leave out
        model.drop_absent_parts(weights.keys())
    settle_absent_head(model, weights.keys(), head_optional, model_path)
    drop_absent_parts(model, weights.keys())
    plan = None
    if sharding is not None:  # after sanitize, which may ask the towers how to map theirs
        from mlxvlm.distributed import sharding as shards

        plan, dropped = shards.prepare(model, *sharding)
        weights = {name: value for name, value in weights.items() if shards.keeps(name, dropped)}
    apply_quantization(model, config, weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise CheckpointError(
            f"the weights in {model_path} do not match the {config.get('model_type')} "
            f"model built from its config.json: {' '.join(str(exc).split())}"
        ) from None  # mlx's message, on one line (it breaks before the names)
    if plan is not None:
        shards.shard(model, plan)
    model.sharding = plan
    return model


def drop_absent_parts(model: nn.Module, weight_names: Iterable[str]) -> None:
    """Remove each of the family's ``optional_parts`` of which the weights (after
    ``sanitize``) hold no tensor, so that the strict load does not miss them."""
    names = list(weight_names)
    for path in model.optional_parts:
        if any(name.startswith(f"{path}.") for name in names):
            continue
        parent_path, _, leaf = path.rpartition(".")
        parent = model
        for part in parent_path.split(".") if parent_path else ():
            parent = parent[part]
        if leaf in parent:
            parent.pop(leaf)


def load_model(
    model_path: Path,
    config: dict | None = None,
    dtype: mx.Dtype | None = None,
    keep_half_weights: bool = False,
    sharding: tuple[mx.distributed.Group, str] | None = None,
    head_optional: bool = False,
    tables_on_disk: bool = False,
) -> nn.Module:
    """The model of the checkpoint at ``model_path``. ``keep_half_weights``: with the
    default compute dtype on the CPU, leave the 16-bit weights of linear and embedding
    layers as they are (for ``mlxvlm.cpu.half_weights``) instead of converting them.
    ``sharding``: see ``build_model`` (a tensor-parallel rank's sharded linear layers keep
    their 16-bit slices too: ``mlxvlm.cpu.half_weights``).
    ``head_optional``: see ``build_model``. ``tables_on_disk``: the family's
    ``gathered_tables`` stay in the weight files, their rows gathered per call
    (``checkpoint.disk_tables``; ``model.tables_on_disk`` lists them); such a model's
    parameters lack them, so it is not for saving."""
    config = config if config is not None else read_config(model_path)
    family = get_family(config.get("model_type"))
    loaded = read_weight_files(model_path)
    weights = {name: array for arrays in loaded.values() for name, array in arrays.items()}
    model = build_model(model_path, config, family, weights, sharding, head_optional)
    del weights
    keep_half_weights = keep_half_weights and dtype is None
    dtype = compute_dtype_for_device(dtype)
    if tables_on_disk:
        from mlxvlm.checkpoint.disk_tables import TensorLocations, keep_tables_on_disk

        swapped = keep_tables_on_disk(model, TensorLocations(loaded), dtype)
        model.tables_on_disk = frozenset(swapped)  # a set: stays out of the module tree
    del loaded  # the tables' lazy tensors go with it, unread
    if dtype == mx.float32 and keep_half_weights:
        from mlxvlm.cpu import ops

        ops.cast_to_float32_keeping_half_weights(model)
    elif dtype is not None:
        model.set_dtype(dtype)
    model.eval()
    materialize(model)
    # A read-only view: a plain dict attribute would join the module's parameter tree.
    model.config = MappingProxyType(config)
    return model


def load(
    path_or_repo: str | Path,
    revision: str | None = None,
    adapter_path: str | Path | None = None,
    trust_remote_code: bool = False,
    dtype: mx.Dtype | None = None,
    cpu_fast_paths: bool = True,
    shard: str | None = None,
    tables_on_disk: bool = True,
):
    """Load a model and its processor from a local directory or a Hugging Face repo.

    Returns ``(model, processor)``. The processor is the transformers processor of the
    family (built without torch); what generation needs from it (the streaming
    detokenizer's TokenizerWrapper, every end-of-sequence id, generation_config.json's
    sampling values) is ``mlxvlm.text.tokenization.processor_state(processor)``.
    ``processor.sampling_defaults`` stays readable (docs/python-api.md).

    ``dtype``: compute dtype for floating weights; by default float32 on the CPU backend
    (faster there than float16/bfloat16) and the checkpoint's own dtype elsewhere.

    ``cpu_fast_paths``: on the CPU backend, keep 16-bit weights 16-bit and compute in
    float32 with mlxvlm's kernels, and run quantized layers through BLAS (see
    ``mlxvlm.cpu.fast_paths``; ``model.cpu_fast_paths`` reports what was done). Pass False
    to keep MLX's own layers and kernels, e.g. for QLoRA training on the quantized weights.

    ``shard``: "tensor" or "pipeline" to split the language model over the group this
    process was launched in (``mlx.launch``; see ``mlxvlm.distributed``), each rank
    reading only its shard's weights; ``model.sharding`` is then the rank's plan. Without
    a launched group (one process) it loads the whole model.

    ``tables_on_disk``: embedding tables of which a token reads one row (Gemma 3n's and
    Gemma 4's per-layer embeddings) stay in the checkpoint's files, memory-mapped, and
    each step gathers the rows it needs (``mlxvlm.checkpoint.disk_tables``). Pass False to
    hold them in memory, e.g. to train or save the whole model.
    """
    from mlxvlm.text.tokenization import attach_processor_state

    sharding = None
    if shard is not None:
        from mlxvlm.distributed.group import launched_group

        group = launched_group()
        sharding = (group, shard) if group is not None else None
    if sharding is not None and not Path(path_or_repo).expanduser().is_dir():
        model_path = _download_shard(str(path_or_repo), revision, trust_remote_code, sharding)
    else:
        model_path = resolve_model_path(path_or_repo, revision, trust_remote_code)
    config = read_config(model_path)
    family = get_family(config.get("model_type"))
    from mlxvlm.retrieval.detection import detect_use

    # Before the weights: an embedder's checkpoint may lack the output head it never calls.
    use = detect_use(config, model_path)
    head_optional = use is not None and not use.needs_output_head
    if cpu_fast_paths:
        from mlxvlm.cpu import ops

        keep = ops.keeps_half_weights()
        model = load_model(model_path, config, dtype=dtype, keep_half_weights=keep,
                           sharding=sharding, head_optional=head_optional,
                           tables_on_disk=tables_on_disk)
        model.cpu_fast_paths = ops.apply_cpu_fast_paths(model)
    else:
        model = load_model(model_path, config, dtype=dtype, sharding=sharding,
                           head_optional=head_optional, tables_on_disk=tables_on_disk)
    processor = family.Model.load_processor(model_path, config)
    from mlxvlm.sampling.defaults import read_checkpoint_defaults

    # generation_config.json's sampling values, for the requests that leave them out.
    state = attach_processor_state(
        processor, collect_eos_token_ids(model_path, config, processor.tokenizer),
        read_checkpoint_defaults(model_path), family.Model.answer_markup_tokens)
    processor.sampling_defaults = state.sampling_defaults  # documented: read by users
    model.retrieval = use
    # Where it came from: what a prompt cache kept on disk is keyed by.
    model.checkpoint_path, model.adapter_path = model_path, adapter_path
    if adapter_path is not None:
        from mlxvlm.checkpoint.adapters import load_adapter

        load_adapter(model, adapter_path)
    # Again, after the fast paths and the adapter: what they built is concrete too, so
    # that the model runs on any thread.
    materialize(model)
    if model.sharding is not None:
        from mlxvlm.distributed.broadcast import barrier

        barrier(model.sharding.group)  # every rank loaded: no collective times out
    return model, processor
