"""A Qwen2.5-Omni checkpoint's voices, ``spk_dict.pt``: a torch pickle ``{name:
{"cond": tensor, "ref_mel": tensor, "bos_token": int}}``, read without torch.

The file is a torch zip archive: ``<root>/data.pkl`` pickles the dictionary, each tensor
rebuilt by ``torch._utils._rebuild_tensor_v2`` from a storage whose bytes are the
archive's ``<root>/data/<key>``. It comes from the Hub, so it is read by an unpickler
that builds only what that format holds -- those tensors (as numpy arrays), their
storage types and the empty ``OrderedDict`` of hooks -- and refuses every other class
(a pickle may name any callable). Read at run time from the checkpoint (and copied as it
is by ``convert``): the Hub's checkpoints load directly, and the file stays the one
transformers reads.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlxvlm.errors import MlxvlmError

FILE_NAME = "spk_dict.pt"

_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": "bfloat16", "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


@dataclass(frozen=True)
class Voice:
    name: str
    conditioning: np.ndarray  # (1, enc_emb_dim) float32
    reference_mel: np.ndarray  # (1, frames, mel_dim) float32
    bos_token: int  # the thinker token whose embedding starts the talker's text


class SpeakerFileError(MlxvlmError):
    """A spk_dict.pt that is not the plain tensors-and-numbers file it should be."""


@dataclass(frozen=True)
class _StorageType:
    name: str


def _rebuild_tensor(storage: np.ndarray, offset: int, size, stride, *_ignored) -> np.ndarray:
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if any(s < 0 for s in stride) or offset < 0:
        raise SpeakerFileError(f"{FILE_NAME} holds a tensor with a negative stride or offset")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else offset - 1
    if last >= storage.size:
        raise SpeakerFileError(f"{FILE_NAME} holds a tensor that reaches past its storage")
    view = np.lib.stride_tricks.as_strided(
        storage[offset:], shape=size, strides=[s * storage.itemsize for s in stride],
        writeable=False)
    return np.array(view)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, root: str):
        super().__init__(io.BytesIO(data))
        self.archive, self.root = archive, root

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise SpeakerFileError(f"{FILE_NAME} refers to {module}.{name}, which a voices file "
                               "does not hold: refusing to load it")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise SpeakerFileError(f"{FILE_NAME} holds an unknown persistent record")
        _, storage_type, key, _location, numel = pid
        raw = self.archive.read(f"{self.root}/data/{key}")
        dtype = _STORAGE_DTYPES[storage_type.name]
        if dtype == "bfloat16":  # the high half of a float32
            halves = np.frombuffer(raw, "<u2")[:numel]
            return (halves.astype(np.uint32) << 16).view(np.float32)
        return np.frombuffer(raw, np.dtype(dtype).newbyteorder("<"))[:numel]


def read_spk_dict(path: str | Path) -> dict:
    """The pickled dictionary, tensors as numpy arrays."""
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise SpeakerFileError(f"cannot read {path}: not a torch zip archive ({exc})") from None
    with archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise SpeakerFileError(f"{path} is not a torch archive (no single data.pkl)")
        root = pickles[0][: -len("/data.pkl")]
        byteorder = f"{root}/byteorder"
        if byteorder in archive.namelist() and archive.read(byteorder).strip() != b"little":
            raise SpeakerFileError(f"{path} is big-endian, which is not supported")
        try:
            return _Unpickler(archive.read(pickles[0]), archive, root).load()
        except SpeakerFileError:
            raise
        except Exception as exc:  # a malformed pickle: one line, not a traceback
            raise SpeakerFileError(f"cannot read {path}: {exc}") from None


def load_voices(checkpoint: str | Path, mel_dim: int) -> dict[str, Voice]:
    """The voices of the checkpoint at ``checkpoint``, by their names in the file."""
    path = Path(checkpoint) / FILE_NAME
    if not path.is_file():
        raise MlxvlmError(f"this model's voices are missing: {path} does not exist "
                          "(Qwen2.5-Omni's talker reads its voices from it)")
    voices = {}
    for name, entry in read_spk_dict(path).items():
        try:
            voices[str(name)] = Voice(
                str(name), np.asarray(entry["cond"], np.float32).reshape(1, -1),
                np.asarray(entry["ref_mel"], np.float32).reshape(1, -1, mel_dim),
                int(entry["bos_token"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise SpeakerFileError(f"{path}: voice {name!r} is not cond, ref_mel and "
                                   f"bos_token ({exc})") from None
    return voices
