"""ColPali and ColQwen2 (the ColVision models): multi-vector retrieval uses."""

from __future__ import annotations

from pathlib import Path


def detect(config: dict, model_path: Path):
    """The use of a ColQwen2 or ColPali checkpoint (model_type ``colqwen2``, ``colpali``)."""
    return None  # the uses land with their families
