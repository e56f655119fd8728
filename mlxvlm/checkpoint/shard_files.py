"""A sharded rank's download of a Hub checkpoint: only the safetensors files that hold a
tensor the rank keeps, with the configs and tokenizer files.

The Hub tells each file's tensors (names, shapes, dtypes) from the files' headers
(``huggingface_hub.get_safetensors_metadata``, a few kilobytes per file) without
downloading them. Each file's tensors become lazy stand-ins (never computed), go through
the family's naming (``sanitize``) as the real ones will, and the file is fetched when
one of them is a tensor the rank's pruned model keeps (``distributed.sharding.keeps``).
A local checkpoint needs none of this: ``mx.load`` maps its files lazily and reads only
what the rank keeps.
"""

from __future__ import annotations

import mlx.core as mx

# safetensors' dtype names -> MLX's
_DTYPES = {
    "F64": mx.float32, "F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16,
    "I64": mx.int64, "I32": mx.int32, "I16": mx.int16, "I8": mx.int8, "U64": mx.uint64,
    "U32": mx.uint32, "U16": mx.uint16, "U8": mx.uint8, "BOOL": mx.bool_,
}


# file name -> (its ``format`` metadata, tensor name -> (shape, safetensors dtype))
HubFiles = dict[str, tuple[str | None, dict[str, tuple[list[int], str]]]]


def files_for_rank(files: HubFiles, config: dict, family, sharding, converted: bool) -> list[str]:
    """The names of ``files`` that hold a tensor this rank keeps under ``sharding``
    (group, mode); ``converted``: their names are already ours (``loading.is_converted``)."""
    from mlxvlm.distributed import sharding as shards

    model = family.Model.from_config(config)
    unused = model.unused_weight_prefixes
    names_per_file: dict[str, list[str] | None] = {}
    for filename, (_, tensors) in files.items():
        stand_ins = {name: mx.zeros(shape, dtype=_DTYPES.get(dtype, mx.float32))
                     for name, (shape, dtype) in tensors.items()
                     if not (unused and name.startswith(unused))}
        if not converted and family.Model.is_hf_checkpoint(stand_ins):
            try:
                stand_ins = model.sanitize(stand_ins)
            except Exception:  # noqa: BLE001  (a file whose naming needs another's tensors)
                names_per_file[filename] = None  # fetched
                continue
        names_per_file[filename] = list(stand_ins)
    _, dropped = shards.prepare(model, *sharding)
    return sorted(f for f, names in names_per_file.items()
                  if names is None or any(shards.keeps(n, dropped) for n in names))


def hub_files(repo: str, revision: str | None) -> HubFiles:
    """Every safetensors file of ``repo`` with its tensors, from the Hub's headers."""
    import huggingface_hub

    metadata = huggingface_hub.get_safetensors_metadata(repo, revision=revision)
    return {filename: ((file.metadata or {}).get("format"),
                       {name: (list(info.shape), info.dtype)
                        for name, info in file.tensors.items()})
            for filename, file in metadata.files_metadata.items()}
