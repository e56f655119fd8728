"""Command-line plumbing shared by the entry points, and the `generate` CLI itself.

Flag names follow mlx-lm's where they exist. User errors (a missing image, an unknown
model type, a prompt that does not fit) print one line to stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from mlxvlm.errors import MlxvlmError
from mlxvlm.option_ranges import SAMPLING, Range, at_least

EXIT_USAGE = 2
# What MLX's quantized KV cache (mx.quantize) takes.
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


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


class _MediaAction(argparse.Action):
    """--image/--video/--audio: extend ``dest`` and record every source with its kind, in
    command-line order, in ``namespace.media``, so the prompt places them as given."""

    def __call__(self, parser, namespace, values, option_string=None):
        getattr(namespace, self.dest).extend(values)
        if getattr(namespace, "media", None) is None:
            namespace.media = []
        namespace.media.extend((self.dest, value) for value in values)


def add_media_arguments(parser: argparse.ArgumentParser) -> None:
    from mlxvlm.media import DEFAULT_FPS, DEFAULT_MAX_FRAMES

    for kind, what in (("image", "Image"), ("video", "Video"), ("audio", "Audio (or video) file")):
        parser.add_argument(
            f"--{kind}",
            action=_MediaAction,
            nargs="+",
            default=[],
            help=f"{what} path, http(s) URL or data URL; repeat or list several (media "
            "enter the prompt in command-line order)",
        )
    parser.set_defaults(media=None)
    parser.add_argument(
        "--fps", type=ranged(Range(float, 0, 1000, low_open=True)), default=None,
        help="Video frames sampled per second (default: the model's own rate, else "
        f"{DEFAULT_FPS:g}); which frames: as the model's transformers processor picks them",
    )
    parser.add_argument(
        "--max-frames", type=ranged(at_least(1)), default=DEFAULT_MAX_FRAMES,
        help="Most frames per video",
    )


def cli_media_policy():
    """The command line reads whatever path or URL its user names, and has no media
    options: the fixes its media errors suggest name none."""
    from mlxvlm.media import NO_NAMES, MediaPolicy

    return MediaPolicy(names=NO_NAMES)


def load_cli_media(args: argparse.Namespace, verbose: bool = False) -> list[tuple[str, object]]:
    """Decode the command line's images and audio in order, and check that each video
    opens and decodes (its first frame): before the slow model load, so that a bad file
    fails fast. Videos are sampled once the model says how (:func:`sample_cli_videos`).
    With ``verbose``, say what was read of each audio."""
    from mlxvlm.media import load_audio, load_image, load_video

    policy = cli_media_policy()
    loaded = []
    for kind, source in args.media or []:
        if kind == "video":
            load_video(source, num_frames=1, with_audio=False, policy=policy)
            loaded.append((kind, source))
            continue
        load = load_image if kind == "image" else load_audio
        media = load(source, policy=policy)
        if verbose and kind == "audio":
            print(f"[mlxvlm] {media.describe()}", file=sys.stderr)
        loaded.append((kind, media))
    return loaded


def sample_cli_videos(media: list[tuple[str, object]], args: argparse.Namespace, processor,
                      verbose: bool = False) -> list[tuple[str, object]]:
    """The videos of ``load_cli_media``'s list decoded at --fps (the model's own rate if
    not given) and sampled as the model's video processor samples; with ``verbose``,
    say what was sampled."""
    from mlxvlm.media import load_video
    from mlxvlm.media.frame_sampling import sampler_for

    video_processor = getattr(processor, "video_processor", None)
    sampler = sampler_for(video_processor) if video_processor is not None else None
    sampled = []
    for kind, value in media:
        if kind == "video":
            value = load_video(value, fps=args.fps, max_frames=args.max_frames, sampler=sampler,
                               policy=cli_media_policy())
            if verbose:
                print(f"[mlxvlm] {value.describe()}", file=sys.stderr)
        sampled.append((kind, value))
    return sampled


def add_speculation_arguments(parser: argparse.ArgumentParser, note: str = "") -> None:
    """Speculative decoding's flags (mlx-lm's and transformers' names), shared with the
    server (``note``: what it adds to the draft flags' help)."""
    parser.add_argument("--draft-model", default=None,
                        help="Speculative decoding with this smaller model (same tokenizer; an "
                        "mlxvlm checkpoint, e.g. a quantized copy of the model, or an mlx-lm "
                        f"text model){note} (default: none)")
    parser.add_argument("--num-draft-tokens", type=ranged(at_least(1, 64)), default=3,
                        help="Tokens the draft model proposes per pass of the model")
    parser.add_argument("--prompt-lookup-num-tokens", type=ranged(at_least(1, 64)), default=None,
                        help="Speculative decoding by prompt lookup: draft up to this many "
                        f"tokens from n-grams of the prompt and the answer{note} (default: off)")


def build_generate_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m mlxvlm.generate",
        description="Generate text from a prompt and images, video or audio with a "
        "vision-language or omni model.",
    )
    add_model_arguments(parser)
    add_media_arguments(parser)
    parser.add_argument(
        "--prompt", "-p", default=None,
        help="The prompt ('-' reads it from stdin; default: 'Describe this image.', or "
        "video/audio after the first medium's kind, without media 'Hello')",
    )
    parser.add_argument("--system", default=None, help="System prompt (default: none)")
    add_sampling_arguments(parser)
    parser.add_argument(
        "--stop", action="append", default=None,
        help="Stop string (repeat for several; default: none, the end-of-sequence tokens stop)",
    )
    parser.add_argument(
        "--max-kv-size",
        type=ranged(at_least(1)),
        default=None,
        help="Rotating KV cache of this many tokens, keeping the prompt's media tokens "
        "(default: a full cache)",
    )
    parser.add_argument("--kv-bits", type=int, choices=KV_BITS, default=None,
                        help="Quantize the KV cache to N bits (default: not quantized)")
    parser.add_argument("--kv-group-size", type=int, choices=KV_GROUP_SIZES, default=64,
                        help="Values per scale of the quantized KV cache")
    parser.add_argument(
        "--quantized-kv-start",
        type=ranged(at_least(0)),
        default=5000,
        help="Quantize the KV cache once it holds this many tokens (with --kv-bits)",
    )
    parser.add_argument("--prefill-step-size", type=ranged(at_least(1)), default=2048,
                        help="Prompt tokens per prefill chunk")
    add_speculation_arguments(parser)
    add_sharding_arguments(parser)
    parser.add_argument(
        "--verbose", action="store_true",
        help="Print statistics, backend details and where the sampling values came from to "
        "stderr (under mlx.launch: what each rank holds)",
    )
    return parser


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
    from mlxvlm.loading import load

    model, processor = load(args.model, revision=args.revision,
                            adapter_path=args.adapter_path,
                            trust_remote_code=args.trust_remote_code,
                            shard="pipeline" if args.pipeline else "tensor", **kwargs)
    plan = getattr(model, "sharding", None)
    if args.verbose and plan is not None:
        print(f"[mlxvlm] {plan.describe()}", file=sys.stderr, flush=True)
    return model, processor


def launched_rank() -> int:
    """This process's rank under mlx.launch (0 when it runs alone)."""
    from mlxvlm.distributed.group import launched_group

    group = launched_group()
    return 0 if group is None else group.rank()


def _prompt_text(args: argparse.Namespace) -> str:
    if args.prompt == "-":
        return sys.stdin.read()
    if args.prompt is not None:
        return args.prompt
    kinds = [kind for kind, _ in args.media or []]
    return f"Describe this {kinds[0]}." if kinds else "Hello"


def _user_turn(text: str, media: list[tuple[str, object]]) -> list[dict]:
    """One user turn: the decoded media in command-line order, then the text."""
    content = [{"type": kind, kind: value} for kind, value in media]
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


def run_generate_cli(argv: Sequence[str] | None = None) -> int:
    parser = build_generate_parser()
    args = parser.parse_args(argv)

    def body() -> int:
        if launched_rank() != 0:  # rank 0 prints the answer; this rank follows it
            from mlxvlm.distributed.follower import follow

            follow(*sharded_load(args))
            return 0
        _generate_on_rank0(args)
        return 0

    return run_cli(body)


def _generate_on_rank0(args: argparse.Namespace) -> None:
    """The CLI's work alone or on rank 0: media, model, the answer printed."""
    import mlx.core as mx

    from mlxvlm.cpu import ops

    # Read the media first: a bad path should fail before a slow model load.
    media = load_cli_media(args, verbose=args.verbose)
    if args.verbose:
        print(f"[mlxvlm] device: {mx.default_device()}", file=sys.stderr)
        for what, status in ops.process_status():
            print(f"[mlxvlm] {what}: {status}", file=sys.stderr)
    model, processor = sharded_load(args)
    try:
        _answer(args, model, processor, media)
    finally:  # the other ranks return, whether the answer came or not
        from mlxvlm.distributed.jobs import release

        release(model)


def _answer(args: argparse.Namespace, model, processor, media) -> None:
    import mlx.core as mx

    from mlxvlm.cpu import ops
    from mlxvlm.generate import stream_generate

    media = sample_cli_videos(media, args, processor, verbose=args.verbose)
    draft = None
    if args.draft_model is not None:
        from mlxvlm.generate.drafters import load_draft

        draft = load_draft(args.draft_model)
    if args.verbose:
        report = getattr(model, "cpu_fast_paths", None)
        if report is not None:
            print(f"[mlxvlm] CPU fast paths: {report.describe()}", file=sys.stderr)
        if mx.default_device() == mx.cpu:
            print(f"[mlxvlm] CPU kernels: {ops.kernels_status()}", file=sys.stderr)
            print("[mlxvlm] compute dtype: float32 (fastest on the CPU backend)", file=sys.stderr)
    if args.verbose:
        from mlxvlm.sampling_defaults import checkpoint_defaults, resolve

        given = {name: getattr(args, name) for name in
                 ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        chosen = resolve(given, checkpoint_defaults(processor))
        print(f"[mlxvlm] sampling: {chosen.describe()}", file=sys.stderr)
    last = None
    for last in stream_generate(
        model,
        processor,
        _user_turn(_prompt_text(args), media),
        system=args.system,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        repetition_context_size=args.repetition_context_size,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=dict(args.logit_bias) if args.logit_bias else None,
        seed=args.seed,
        stop=args.stop,
        max_kv_size=args.max_kv_size,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
        prefill_step_size=args.prefill_step_size,
        draft_model=draft,
        num_draft_tokens=args.num_draft_tokens,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
    ):
        print(last.text, end="", flush=True)
    print()
    if args.verbose and last is not None:
        print(
            f"[mlxvlm] prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens/s\n"
            f"[mlxvlm] generation: {last.generation_tokens} tokens, "
            f"{last.generation_tps:.1f} tokens/s ({last.finish_reason})\n"
            f"[mlxvlm] peak memory: {last.peak_memory:.3f} GB",
            file=sys.stderr,
        )
        if last.speculation is not None:
            print(f"[mlxvlm] speculation: {last.speculation.describe()}", file=sys.stderr)
