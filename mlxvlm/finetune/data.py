"""Training records from local JSONL files or Hugging Face datasets.

A record is one conversation: ``messages`` in the OpenAI / transformers shape, whose image
parts either name their image (``{"type": "image", "image": "cat.png"}``) or take the next
entry of the record's ``images`` list (``{"type": "image"}``, TRL's VLM SFT layout):

    {"messages": [{"role": "user", "content": [{"type": "image"},
                                               {"type": "text", "text": "What is it?"}]},
                  {"role": "assistant", "content": "A red circle."}],
     "images": ["shapes/0001.png"]}

Local image paths are relative to the JSONL file (or absolute). ``--data`` is a JSONL
file, a folder with ``train.jsonl`` (and optionally ``valid.jsonl``, as mlx-lm's), a
dataset saved with ``datasets``' ``save_to_disk``, or a Hub dataset id (``name`` or
``name:split``), whose ``images`` column holds images (PIL) or paths.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mlxvlm.errors import MlxvlmError

TRAIN_FILE = "train.jsonl"
VALID_FILE = "valid.jsonl"
FOLDER_LAYOUT = f"a data folder holds {TRAIN_FILE} and, for validation, {VALID_FILE}"
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, data: ...
# A Hub dataset id as the Hub spells one (``name`` or ``owner/name``), then ``:split``.
_HUB_DATASET = re.compile(r"^(?:[\w.-]+/)?[\w.-]+(?::[\w.-]+)?$")
# What datasets' save_to_disk writes in a folder (a Dataset; a DatasetDict).
_SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")


@dataclass
class Record:
    messages: Any
    images: Any  # sources for image parts that name none, in order
    location: str  # where the record is, for messages: "data/train.jsonl:12"
    base_dir: Path | None = None  # relative image paths resolve against it

    def resolve(self, source: Any) -> Any:
        """An image source as given, with a relative local path made absolute."""
        if isinstance(source, dict):  # datasets' undecoded Image: {"bytes", "path"}
            source = source.get("bytes") or source.get("path")
        if isinstance(source, (str, os.PathLike)) and self.base_dir is not None:
            text = os.fspath(source)
            if not _URL.match(text) and not os.path.isabs(os.path.expanduser(text)):
                return self.base_dir / text
        return source


@dataclass
class BadRecord:
    location: str
    reason: str

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}"


class BadRecordsError(MlxvlmError):
    """Some records cannot be trained on; lists them (the CLI prints it on one line)."""

    def __init__(self, bad: Sequence[BadRecord], shown: int = 5):
        self.bad = list(bad)
        listed = "; ".join(str(b) for b in self.bad[:shown])
        more = f"; and {len(self.bad) - shown} more" if len(self.bad) > shown else ""
        super().__init__(
            f"{len(self.bad)} bad record(s): {listed}{more} (fix them, or pass "
            "--skip-bad-records to train without them)"
        )


class RecordSource(Sequence[Record]):
    """An indexable collection of records, plus those that could not even be parsed."""

    def __init__(self, name: str, records: Sequence[Record], bad: Sequence[BadRecord] = ()):
        self.name = name
        self._records = records
        self.unparsable = list(bad)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index):
        return self._records[index]


# ------------------------------------------------------------------------------- JSONL


def read_jsonl(path: Path) -> RecordSource:
    records: list[Record] = []
    bad: list[BadRecord] = []
    base_dir = path.parent.resolve()
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            location = f"{path}:{number}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                bad.append(BadRecord(location, f"not valid JSON ({exc.msg})"))
                continue
            if not isinstance(data, dict):
                bad.append(BadRecord(location, "a record must be a JSON object"))
                continue
            records.append(Record(data.get("messages"), data.get("images"), location, base_dir))
    return RecordSource(str(path), records, bad)


# ----------------------------------------------------------------------- HF datasets


class _DatasetRecords(Sequence[Record]):
    """Rows of a ``datasets.Dataset`` as records, read (and images decoded) on demand."""

    def __init__(self, dataset, name: str):
        missing = {"messages"} - set(dataset.column_names)
        if missing:
            raise MlxvlmError(
                f"dataset {name} has no 'messages' column (columns: "
                f"{', '.join(dataset.column_names)}); it needs 'messages' and 'images'"
            )
        self.dataset = dataset
        self.name = name
        self.has_images = "images" in dataset.column_names

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Record:
        row = self.dataset[int(index)]
        images = row.get("images") if self.has_images else None
        return Record(row["messages"], images, f"{self.name} row {index}")


def load_hf_dataset(spec: str, default_split: str) -> RecordSource:
    """A dataset saved with ``save_to_disk`` (a folder), or ``name[:split]`` on the Hub."""
    path = Path(spec).expanduser()
    try:
        import datasets
    except ImportError:
        what = ("a dataset saved with save_to_disk" if path.is_dir()
                else "not a local JSONL file or folder")
        raise MlxvlmError(
            f"{spec} is {what}; reading Hugging Face datasets "
            "needs the `datasets` package: pip install 'mlxvlm[train]'"
        ) from None
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if default_split not in loaded:
                raise MlxvlmError(f"{spec} has no split {default_split!r} ({', '.join(loaded)})")
            loaded = loaded[default_split]
        return RecordSource(f"{spec}", _DatasetRecords(loaded, spec))
    name, _, split = spec.partition(":")
    split = split or default_split
    try:
        loaded = datasets.load_dataset(name, split=split)
    except Exception as exc:  # datasets raises many types for a missing name or split
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MlxvlmError(
            f"cannot load dataset {spec!r} from the Hub (there is no folder or file {spec} "
            f"here either): {reason}"
        ) from None
    return RecordSource(f"{name}:{split}", _DatasetRecords(loaded, f"{name}:{split}"))


# ----------------------------------------------------------------------------- entry


def looks_like_a_path(text: str) -> bool:
    """Whether ``--data`` names a local file or folder rather than a Hub dataset: what
    starts as a path does, ends with a separator, names a JSON(L) file or cannot be a Hub
    id (``owner/name[:split]``)."""
    separators = tuple(s for s in (os.sep, os.altsep) if s)
    return (text.startswith((".", "~", *separators)) or text.endswith(separators)
            or text.endswith((".jsonl", ".json")) or not _HUB_DATASET.match(text))


def open_records(spec: str | os.PathLike, *, split: str = "train",
                 flag: str = "--data") -> RecordSource:
    """Records from ``spec`` (see the module docstring). ``split`` picks ``train.jsonl``
    or ``valid.jsonl`` in a folder, and the split of a dataset; ``flag`` is the option
    that gave ``spec``, for errors."""
    path = Path(spec).expanduser()
    text = os.fspath(spec)
    if path.is_file():
        return read_jsonl(path)
    if path.is_dir():
        name = TRAIN_FILE if split == "train" else VALID_FILE
        if (path / name).is_file():
            return read_jsonl(path / name)
        if not any((path / saved).is_file() for saved in _SAVED_DATASET_FILES):
            raise MlxvlmError(f"{flag} {text}: the folder has no {name} ({FOLDER_LAYOUT}; or "
                              "give a dataset saved with datasets' save_to_disk)")
        return load_hf_dataset(str(path), split)
    if looks_like_a_path(text):
        raise MlxvlmError(f"{flag} {text}: no such folder or file (looked for "
                          f"{path.absolute()}; {FOLDER_LAYOUT})")
    return load_hf_dataset(text, split)


def default_validation(spec: str | os.PathLike) -> RecordSource | None:
    """The validation records that come with the training data: ``valid.jsonl`` beside
    ``train.jsonl`` in a data folder; None otherwise."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / VALID_FILE).is_file():
        return read_jsonl(path / VALID_FILE)
    return None
