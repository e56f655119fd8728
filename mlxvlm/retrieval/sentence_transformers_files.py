"""What a checkpoint's sentence-transformers files say: ``modules.json`` lists the
modules a ``SentenceTransformer`` or ``CrossEncoder`` chains (each with its class path
and the folder of its ``config.json``). Detectors read it to tell an embedding model or a
reranker from a chat model of the same ``model_type``; nothing here imports
sentence-transformers."""

from __future__ import annotations

import json
from pathlib import Path


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _entries(model_path: Path) -> list[dict]:
    entries = _read_json(Path(model_path) / "modules.json")
    if not isinstance(entries, list):
        return []
    return [entry for entry in entries if isinstance(entry, dict)]


def st_modules(model_path: Path) -> list[tuple[str, dict | None]]:
    """``modules.json``'s modules in order, each as (its class name, its config): e.g.
    ``("Pooling", {"pooling_mode": "lasttoken", ...})``; [] without the file. The config
    is None where its folder's ``config.json`` is missing or unreadable (a copy that
    kept ``modules.json`` alone), and for the input module (folder "")."""
    modules = []
    for entry in _entries(model_path):
        name = str(entry.get("type", "")).rsplit(".", 1)[-1]
        folder = str(entry.get("path", ""))
        config = _read_json(Path(model_path) / folder / "config.json") if folder else None
        modules.append((name, config if isinstance(config, dict) else None))
    return modules


def module_folders(model_path: Path) -> list[str]:
    """The folders of ``modules.json``'s modules that have one (``1_Pooling`` ...): what a
    copy of the checkpoint (``mlxvlm.convert``) carries along to stay recognizable."""
    folders = [str(entry.get("path", "")) for entry in _entries(model_path)]
    return [folder for folder in folders
            if folder and (Path(model_path) / folder).is_dir() and ".." not in Path(folder).parts]


def pools_last_token(config: dict) -> bool:
    """A Pooling module's config asks for the last token (sentence-transformers 5's
    ``pooling_mode``, a name or a list of one, or the older ``pooling_mode_lasttoken``
    switch)."""
    mode = config.get("pooling_mode")
    return mode in ("lasttoken", ["lasttoken"]) or config.get("pooling_mode_lasttoken") is True


def named(model_path: Path, model_name: str) -> bool:
    """Whether the checkpoint's folder (or the Hub cache's ``models--Org--Name`` above its
    snapshot) carries ``model_name``, case apart: the Hub's repository name, for
    checkpoints without sentence-transformers files."""
    parts = Path(model_path).resolve().parts
    names = [parts[-1]]
    if len(parts) >= 3 and parts[-2] == "snapshots":
        names.append(parts[-3])
    return any(model_name.lower() in name.lower() for name in names)
