"""Command-line plumbing shared by the entry points: the parser every one uses, shared
flag groups, the one-line error exit, the port check, a sharded load. Each command's own
body lives with it (``generate/__main__.py``, ``server/__main__.py``, ...).

Flag names follow mlx-lm's where they exist. User errors (a missing image, an unknown
model type, a prompt that does not fit) print one line to stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from mlxvlm.errors import MlxvlmError
from mlxvlm.sampling.ranges import SAMPLING, Range, at_least

EXIT_USAGE = 2


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, unless the help already says it or there
    is none to show (None, a flag's False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text.lower() or default in (None, False, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """The parser of every entry point: usage errors (an unknown flag, a value out of its
    range) as one line ``error: ...`` on stderr and exit code 2, like every other user
    error; ``--help`` shows each option's default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)

    def parse_args(self, args=None, namespace=None):
        # argparse's own, with the closest known flag named for each unknown one.
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}"
                       f"{did_you_mean(unknown, self.long_options())}")
        return parsed

    def long_options(self) -> list[str]:
        return [s for s in self._option_string_actions if s.startswith("--") and s != "--help"]


# Other tools' names for flags that have another name here (transformers, llama.cpp,
# vLLM, mlx-vlm...): a user coming from them types these first.
FLAG_ALIASES = {
    "--max-new-tokens": "--max-tokens",
    "--max-length": "--max-tokens",
    "--n-predict": "--max-tokens",
    "--img": "--image",
    "--images": "--image",
    "--image-file": "--image",
    "--image-path": "--image",
    "--videos": "--video",
    "--audios": "--audio",
    "--temp": "--temperature",
    "--model-path": "--model",
    "--model-id": "--model",
    "--model-name": "--model",
    "--system-prompt": "--system",
    "--adapter": "--adapter-path",
    "--adapters": "--adapter-path",
    "--lora": "--adapter-path",
    "--lora-path": "--adapter-path",
}


def closest_option(given: str, known: Sequence[str]) -> str | None:
    """The flag of ``known`` that ``given`` (an unknown flag, maybe ``--flag=value``) most
    likely meant: another tool's name for it, the same name with hyphens, or the nearest
    spelling; None if nothing is near."""
    import difflib

    name = given.split("=", 1)[0]
    if not name.startswith("--"):
        return None
    hyphenated = name.replace("_", "-")
    for candidate in (FLAG_ALIASES.get(hyphenated), hyphenated):
        if candidate in known and candidate != name:
            return candidate
    if hyphenated in FLAG_ALIASES:  # another tool's name for a flag this one lacks
        return None
    close = difflib.get_close_matches(hyphenated, known, n=1, cutoff=0.7)
    return close[0] if close else None


def did_you_mean(unknown: Sequence[str], known: Sequence[str]) -> str:
    """`` (did you mean --image?)`` for argparse's unknown arguments, or ``""``."""
    pairs = [(u.split("=", 1)[0], closest_option(u, known)) for u in unknown]
    pairs = [(given, meant) for given, meant in pairs if meant]
    if not pairs:
        return ""
    if len(pairs) == 1:
        return f" (did you mean {pairs[0][1]}?)"
    return " (did you mean " + ", ".join(f"{m} for {g}" for g, m in pairs) + "?)"


def ranged(valid: Range):
    """The argparse ``type`` of an option whose values must lie in ``valid``."""
    return valid.argtype()


def require_extra(extra: str, what: str, modules: Sequence[str]) -> None:
    """Raise a one-line ``MlxvlmError`` naming the install command when one of the
    optional ``modules`` of ``extra`` is missing."""
    import importlib.util

    for module in modules:
        # Found, not imported: importing Gradio takes seconds, and it comes later anyway.
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise MlxvlmError(
                f"{what} needs {module}, which is not installed: pip install -e \".[{extra}]\" "
                f"in a clone, or pip install \"mlxvlm[{extra}]\""
            )


def run_cli(body: Callable[[], int | None]) -> int:
    """Run a CLI body, turning user errors into one line on stderr and exit code 2."""
    try:
        return body() or 0
    except MlxvlmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def port_in_use(host: str, port: int) -> MlxvlmError:
    return MlxvlmError(f"port {port} on {host} is in use: pass --port N (or stop what is "
                       "using it)")


def open_listener(host: str, port: int):
    """A listening TCP socket on ``host``:``port`` (IPv6 where ``host`` has a colon, as
    uvicorn and Gradio bind), or a one-line ``MlxvlmError`` naming the flag to change.
    The server and the chat UI open it before the model loads, so that a port in use is
    said at once, not after a load that can take minutes."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn and Gradio do: a port whose earlier connections are in TIME_WAIT is
        # free to listen on.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except socket.gaierror:
        sock.close()
        raise MlxvlmError(f"--host {host!r} is not an address or host name this machine "
                          "can listen on (e.g. 127.0.0.1, or 0.0.0.0 for every address)") from None
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise port_in_use(host, port) from None
        if exc.errno == errno.EACCES:
            raise MlxvlmError(f"not allowed to listen on port {port} (ports below 1024 need "
                              "administrator rights): pass --port 1024 or higher") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise MlxvlmError(f"--host {host} is not an address of this machine") from None
        raise MlxvlmError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def checkpoint_folders(models_dir: str) -> list:
    """``--models-dir``: the folders right under it that hold a config.json, sorted (the
    server names them by folder, the chat by path)."""
    from pathlib import Path

    folder = Path(models_dir)
    if not folder.is_dir():
        raise MlxvlmError(f"--models-dir {models_dir!r} is not a folder")
    found = sorted(p for p in folder.iterdir() if (p / "config.json").is_file())
    if not found:
        raise MlxvlmError(f"--models-dir {models_dir!r} has no checkpoint folders "
                          "(subfolders with a config.json)")
    return found


def add_model_arguments(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """``several``: ``--model`` may be repeated (a list, None when not given)."""
    if several:
        parser.add_argument("--model", action="append", default=None,
                            help="Local checkpoint directory or Hugging Face repo id; "
                            "repeat to serve several (the first is loaded at start)")
    else:
        parser.add_argument(
            "--model", required=True, help="Local checkpoint directory or Hugging Face repo id"
        )
    parser.add_argument("--revision", default=None,
                        help="Hub revision: branch, tag or commit (default: main)")
    parser.add_argument("--adapter-path", default=None,
                        help="LoRA adapter (PEFT format) to apply (default: none)")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Also download the repo's *.py files (needed by some processors)",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    # None: not given, so the checkpoint's generation_config.json (or greedy) decides.
    checkpoint = "default: the checkpoint's generation_config.json, else"
    parser.add_argument("--max-tokens", "-m", type=ranged(SAMPLING["max_tokens"]), default=256,
                        help="Maximum new tokens")
    parser.add_argument("--temperature", "--temp", type=ranged(SAMPLING["temperature"]),
                        default=None, help=f"Sampling temperature, 0 = greedy ({checkpoint} 0)")
    parser.add_argument("--top-p", type=ranged(SAMPLING["top_p"]), default=None,
                        help=f"Nucleus sampling threshold in (0, 1] ({checkpoint} 1: off)")
    parser.add_argument("--top-k", type=ranged(SAMPLING["top_k"]), default=None,
                        help=f"Top-k sampling ({checkpoint} 0: off)")
    parser.add_argument("--min-p", type=ranged(SAMPLING["min_p"]), default=None,
                        help=f"Min-p sampling in [0, 1] ({checkpoint} 0: off)")
    parser.add_argument("--repetition-penalty", type=ranged(SAMPLING["repetition_penalty"]),
                        default=None,
                        help=f"Repetition penalty, 1 = none ({checkpoint} none)")
    parser.add_argument("--repetition-context-size",
                        type=ranged(SAMPLING["repetition_context_size"]), default=20,
                        help="Recent tokens the repetition penalty looks at")
    parser.add_argument("--presence-penalty", type=ranged(SAMPLING["presence_penalty"]),
                        default=None,
                        help="Penalty on every token already generated, as OpenAI's "
                        "(default: none)")
    parser.add_argument("--frequency-penalty", type=ranged(SAMPLING["frequency_penalty"]),
                        default=None,
                        help="Penalty per earlier occurrence of a generated token, as "
                        "OpenAI's (default: none)")
    parser.add_argument("--logit-bias", type=_logit_bias, action="append", default=None,
                        metavar="TOKEN=BIAS",
                        help="Add BIAS (-100 to 100) to token id TOKEN's logit; repeat for "
                        "several (default: none)")
    parser.add_argument("--seed", type=ranged(SAMPLING["seed"]), default=None,
                        help="Random seed for sampling (default: random)")


def _logit_bias(text: str) -> tuple[int, float]:
    """``TOKEN=BIAS``, both checked against the ranges the server uses."""
    token, sep, bias = text.partition("=")
    try:
        pair = (int(token), float(bias))
    except ValueError:
        pair = None
    if pair is None or not sep:
        raise argparse.ArgumentTypeError(f"expected TOKEN=BIAS, got {text!r}")
    problem = at_least(0).problem(pair[0]) or SAMPLING["logit_bias_value"].problem(pair[1])
    if problem:
        raise argparse.ArgumentTypeError(f"{problem} (in {text!r})")
    return pair


def add_speculation_arguments(parser: argparse.ArgumentParser, note: str = "") -> None:
    """Speculative decoding's flags (mlx-lm's and transformers' names), shared with the
    server (``note``: what it adds to the draft flags' help)."""
    parser.add_argument("--draft-model", default=None,
                        help="Speculative decoding with this smaller model (same tokenizer; an "
                        "mlxvlm checkpoint, e.g. a quantized copy of the model, or an mlx-lm "
                        f"text model){note} (default: none)")
    parser.add_argument("--num-draft-tokens", type=ranged(at_least(1, 64)), default=3,
                        help="Tokens the draft model (or the MTP head, chained) proposes per "
                        "pass of the model")
    parser.add_argument("--mtp", action="store_true",
                        help="Speculative decoding with the checkpoint's own multi-token-"
                        "prediction head (Qwen3.5, Qwen3.5-MoE, MiniCPM-V 4.6: the Hub's mtp.* "
                        "weights), "
                        f"chained --num-draft-tokens steps{note} (default: off)")
    parser.add_argument("--prompt-lookup-num-tokens", type=ranged(at_least(1, 64)), default=None,
                        help="Speculative decoding by prompt lookup: draft up to this many "
                        f"tokens from n-grams of the prompt and the answer{note} (default: off)")


def add_sharding_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pipeline", action="store_true",
        help="Under mlx.launch: split the language model's layers over the ranks "
        "(pipeline parallelism; default: tensor parallelism, a slice of every layer)",
    )


def sharded_load(args: argparse.Namespace, **kwargs):
    """``load`` for an entry point: under mlx.launch (a group of more than one), this
    rank's shard of the model, in the mode ``--pipeline`` chose; with ``--verbose`` each
    rank says what it holds."""
    from mlxvlm.checkpoint.loading import load

    model, processor = load(args.model, revision=args.revision,
                            adapter_path=args.adapter_path,
                            trust_remote_code=args.trust_remote_code,
                            shard="pipeline" if args.pipeline else "tensor", **kwargs)
    plan = model.sharding
    if args.verbose and plan is not None:
        print(f"[mlxvlm] {plan.describe()}", file=sys.stderr, flush=True)
    return model, processor


def launched_rank() -> int:
    """This process's rank under mlx.launch (0 when it runs alone)."""
    from mlxvlm.distributed.group import launched_group

    group = launched_group()
    return 0 if group is None else group.rank()
