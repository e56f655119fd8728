"""A benchmark checkpoint with a byte-level BPE tokenizer of a real model's size.

    python benchmarks/bpe_checkpoint.py            # -> benchmarks/checkpoints/smolvlm-256m-bpe

``checkpoints.py``'s smolvlm-256m-bf16 (SmolVLM-256M's shapes, random weights) with its
word-level tokenizer (which llguidance cannot use: it has no byte-level view of its
tokens) replaced by a byte-level BPE trained offline with ``tokenizers`` on the Python
sources of this environment: 49152 entries, ``<|endoftext|>``, ``<|im_start|>`` and
``<|im_end|>`` first, then the image tokens at SmolVLM's ids, as SmolVLM's own tokenizer
lays them out. The weights are linked, not copied.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "checkpoints" / "smolvlm-256m-bf16"
TARGET = HERE / "checkpoints" / "smolvlm-256m-bpe"
BPE_SIZE = 49152  # SmolVLM's: byte-level BPE entries before its added tokens
CORPUS_BYTES = 24 * 2**20


def corpus(limit: int = CORPUS_BYTES):
    """Python sources of this environment's site-packages, sorted (the same text on
    every run of one environment), up to ``limit`` bytes."""
    taken = 0
    for path in sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        taken += len(text)
        if taken >= limit:
            return


def train_tokenizer(added: dict[str, int]):
    """The BPE, then each added token at its id (``added``: token -> id, the ids above the
    BPE's filled with unused reserved tokens)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    first = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_SIZE, special_tokens=first,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != BPE_SIZE:
        raise SystemExit(f"the corpus gave {tokenizer.get_vocab_size()} BPE entries, "
                         f"not {BPE_SIZE}")
    by_id = {index: token for token, index in added.items()}
    for index in range(BPE_SIZE, max(by_id) + 1):
        token = by_id.get(index, f"<reserved_{index}>")
        tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)])
        assert tokenizer.token_to_id(token) == index, token
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<end_of_utterance>",
                                   pad_token="<|im_end|>", bos_token="<|im_start|>",
                                   unk_token=None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=SOURCE)
    parser.add_argument("--target", type=Path, default=TARGET)
    args = parser.parse_args()
    if not (args.source / "config.json").exists():
        raise SystemExit(f"{args.source} is missing: run benchmarks/checkpoints.py "
                         "--only smolvlm-256m first")
    old = json.loads((args.source / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in old["added_tokens"] if t["id"] >= BPE_SIZE}
    tokenizer = train_tokenizer(added)
    args.target.mkdir(parents=True, exist_ok=True)
    for item in args.source.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens")):
            continue
        link = args.target / item.name
        if link.exists() or link.is_symlink():
            link.unlink()
        if item.suffix == ".safetensors":
            link.symlink_to(item)
        else:
            shutil.copy(item, link)
    tokenizer.save_pretrained(args.target)
    print(f"wrote {args.target} ({len(tokenizer)} tokens)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
