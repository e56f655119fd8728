"""``python -m mlxvlm.embed`` (and ``mlxvlm embed``, ``mlxvlm-embed``): embed texts and
pictures with a retrieval model, rank them against a query, or index a folder of
pictures to JSONL.

    mlxvlm embed --model M --text "a query" --image page.png       # JSON per input
    mlxvlm embed --model M --query "invoices from May" --input-dir scans/
    mlxvlm embed --model M --input-dir scans/ --output index.jsonl

User errors print one line to stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from mlxvlm.cli import OneLineParser, add_model_arguments, ranged, run_cli
from mlxvlm.errors import MlxvlmError
from mlxvlm.sampling.ranges import at_least

# What --input-dir reads as pictures (Pillow opens them all).
PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
# Pictures read and embedded at once when indexing a folder (the model's batch size
# applies within), so that a large folder is never held in memory whole.
INDEX_CHUNK = 64
# Values of each input's first vector shown in the summary (--print-vectors: all).
HEAD = 4


class _InputAction(argparse.Action):
    """--text/--image: every input with its kind, in command-line order."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, "inputs", None) is None:
            namespace.inputs = []
        namespace.inputs.extend((self.dest, value) for value in values)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="mlxvlm embed",
        description="Embed texts and pictures with a retrieval model (ColQwen2, ColPali, "
        "Qwen3-VL-Embedding), rank them against --query (also with a reranker), or index "
        "a folder of pictures to JSONL.",
    )
    add_model_arguments(parser)
    parser.add_argument("--text", action=_InputAction, nargs="+", default=None,
                        help="Text to embed (a query); repeat or list several")
    parser.add_argument("--image", action=_InputAction, nargs="+", default=None,
                        help="Picture to embed (a page, a photo): path, http(s) URL or data "
                        "URL; repeat or list several")
    parser.set_defaults(inputs=None)
    parser.add_argument("--input-dir", default=None,
                        help="Folder whose pictures (" + ", ".join(PICTURE_SUFFIXES) +
                        ") are embedded, in name order, each as one input")
    parser.add_argument("--query", default=None,
                        help="Rank the inputs against this text, best first, instead of "
                        "printing their vectors")
    parser.add_argument("--output", "-o", default=None,
                        help="With --input-dir: the JSONL file to write (one line per "
                        "picture: path, shape, tokens, embedding; default: stdout)")
    parser.add_argument("--instruction", default=None,
                        help="Task description, for the models that take one "
                        "(Qwen3-VL-Embedding; default: the model's)")
    parser.add_argument("--batch-size", type=ranged(at_least(1)), default=None,
                        help="Inputs per forward pass (default: the model's)")
    parser.add_argument("--print-vectors", action="store_true",
                        help="Print every vector (default: each input's shape and the "
                        f"first {HEAD} values of its first vector)")
    return parser


def pictures_in(folder: str) -> list[Path]:
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise MlxvlmError(f"--input-dir {folder!r} is not a folder")
    found = sorted(p for p in path.iterdir()
                   if p.is_file() and p.suffix.lower() in PICTURE_SUFFIXES)
    if not found:
        raise MlxvlmError(f"--input-dir {folder!r} holds no pictures "
                          f"({', '.join(PICTURE_SUFFIXES)})")
    return found


def command_line_inputs(args: argparse.Namespace, policy) -> list[tuple[str, Any]]:
    """(label, input) for each --text and --image, in order (their pictures loaded), then
    the folder's pictures (by path)."""
    from mlxvlm.retrieval.inputs import retrieval_input

    inputs = [(f"{kind}: {value}",
               value if kind == "text" else retrieval_input({"image": value}, f"--image {value}",
                                                           policy))
              for kind, value in args.inputs or []]
    if args.input_dir is not None:
        inputs += [(str(p), {"image": str(p)}) for p in pictures_in(args.input_dir)]
    return inputs


def summary(label: str, vectors, tokens: int, full: bool) -> dict:
    import numpy as np

    vectors = np.asarray(vectors, dtype=np.float32)
    line: dict = {"input": label, "shape": list(vectors.shape), "tokens": tokens}
    if full:
        line["embedding"] = vectors.tolist()
    else:
        line["head"] = [round(float(v), 6) for v in vectors.reshape(-1, vectors.shape[-1])[0][:HEAD]]
    return line


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.output is not None and args.input_dir is None:
        parser.error("--output goes with --input-dir (the folder's index)")
    if not args.inputs and args.input_dir is None:
        parser.error("nothing to embed: give --text, --image or --input-dir")

    def body() -> None:
        from mlxvlm.media import MediaPolicy, NO_NAMES

        policy = MediaPolicy(names=NO_NAMES)
        # A bad folder or picture fails before the slow model load (a folder's pictures
        # are read as they are embedded).
        inputs = command_line_inputs(args, policy)
        from mlxvlm.checkpoint.loading import load
        from mlxvlm.retrieval.api import retrieval_use

        model, processor = load(args.model, revision=args.revision,
                                adapter_path=args.adapter_path,
                                trust_remote_code=args.trust_remote_code)
        use = retrieval_use(model, "rerank" if args.query is not None else "embed")
        if args.query is not None:
            rank(model, processor, args, inputs, policy)
        elif args.input_dir is not None:
            index(model, processor, args, inputs, policy, use.kind)
        else:
            embed_each(model, processor, args, inputs, policy)

    return run_cli(body)


def rank(model, processor, args, inputs, policy) -> None:
    """The inputs, best first, one JSON line each: rank, score, input."""
    from mlxvlm.retrieval.api import rerank

    scores = rerank(model, processor, args.query, [value for _, value in inputs],
                    args.instruction, batch_size=args.batch_size, policy=policy)
    order = sorted(range(len(inputs)), key=lambda i: -scores[i])
    for place, i in enumerate(order, start=1):
        print(json.dumps({"rank": place, "score": round(scores[i], 6), "input": inputs[i][0]}))


def embed_each(model, processor, args, inputs, policy) -> None:
    from mlxvlm.retrieval.api import encode
    from mlxvlm.retrieval.inputs import retrieval_inputs

    items = retrieval_inputs([value for _, value in inputs], model.retrieval, "inputs", policy)
    encoded = encode(model, processor, items, instruction=args.instruction,
                     batch_size=args.batch_size)
    for (label, _), vectors, tokens in zip(inputs, encoded.vectors, encoded.tokens):
        print(json.dumps(summary(label, vectors, tokens, args.print_vectors)))


def index(model, processor, args, inputs, policy, kind: str) -> None:
    """One JSONL line per picture, written as each chunk is embedded, with progress."""
    from mlxvlm.retrieval.api import batches, encode, progress_bar
    from mlxvlm.retrieval.inputs import retrieval_inputs

    output = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        with progress_bar(len(inputs), True, "indexing") as advance:
            for chunk in batches(inputs, INDEX_CHUNK):
                items = retrieval_inputs([value for _, value in chunk], model.retrieval,
                                         "inputs", policy)
                encoded = encode(model, processor, items, instruction=args.instruction,
                                 batch_size=args.batch_size, progress=False)
                for (label, _), vectors, tokens in zip(chunk, encoded.vectors, encoded.tokens):
                    line = summary(label, vectors, tokens, full=True)
                    output.write(json.dumps({"path": line.pop("input"), **line}) + "\n")
                output.flush()
                advance(len(chunk))
    finally:
        if output is not sys.stdout:
            output.close()
    if args.output:
        print(f"indexed {len(inputs)} pictures ({kind}) into {args.output}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
