"""A copy of a benchmark checkpoint in the layout mlx-vlm 0.7.10 parses.

    python benchmarks/mlx_vlm_copy.py glm-ocr-bf16      # writes glm-ocr-bf16-mlx-vlm/

transformers 5 writes ``dtype`` into every sub-config (and GLM-OCR's ``rope_parameters``
into its vision config); mlx-vlm's GLM-OCR builds its vision config's dataclass from that
dict as it is and stops on the keys it has no field for. The copy links every file but
config.json, whose sub-configs lose those keys: the weights and the model are the same.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"
# Sub-config keys mlx-vlm 0.7.10's dataclasses do not take (transformers 5 writes them)
DROPPED = {"vision_config": ("dtype", "rope_parameters")}


def mlx_vlm_copy(source: Path) -> Path:
    target = source.with_name(source.name + "-mlx-vlm")
    target.mkdir(exist_ok=True)
    for path in source.iterdir():
        link = target / path.name
        if path.name != "config.json" and not link.exists():
            link.symlink_to(path.resolve())
    config = json.loads((source / "config.json").read_text())
    for section, keys in DROPPED.items():
        for key in keys:
            config.get(section, {}).pop(key, None)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


if __name__ == "__main__":
    name = Path(sys.argv[1])
    print(mlx_vlm_copy(name if name.is_dir() else CHECKPOINTS / name))
