"""``python -m mlxvlm.generate`` (and ``mlxvlm generate``, ``mlxvlm-generate``): answer a
prompt about images, video or audio from the command line, over the shared loop.

Flag names follow mlx-lm's where they exist. User errors (a missing image, an unknown
model type, a prompt that does not fit) print one line to stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from mlxvlm.cli import (OneLineParser, add_model_arguments, add_sampling_arguments,
                        add_sharding_arguments, add_speculation_arguments, launched_rank,
                        ranged, run_cli, sharded_load)
from mlxvlm.sampling.ranges import Range, at_least

# What MLX's quantized KV cache (mx.quantize) takes.
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


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
    parser.add_argument(
        "--pdf", action=_MediaAction, nargs="+", default=[],
        help="PDF path, http(s) URL or data URL (--image takes a PDF too); its pages "
        "become images: one page is answered in one prompt, several pages each in turn",
    )
    parser.set_defaults(media=None)
    from mlxvlm.media.pdf import DEFAULT_DPI

    parser.add_argument(
        "--pages", type=_page_spec, default=None,
        help="The PDF's pages to read, 1-based: e.g. 1-3,5 or 4- (default: all)",
    )
    parser.add_argument(
        "--dpi", type=ranged(Range(float, 0, 1200, low_open=True)), default=DEFAULT_DPI,
        help="Resolution the PDF's pages are rendered at (a page is scaled down to at most "
        "16.8 M pixels; the model's processor resizes it again)",
    )
    parser.add_argument(
        "--output-dir", default=None,
        help="With a PDF: write each page's answer to DIR/page-001.md, ... instead of "
        "printing them under '## Page N' headers",
    )
    from mlxvlm.text.doctags import OUTPUT_FORMATS

    parser.add_argument(
        "--output-format", choices=OUTPUT_FORMATS, default=None,
        help="For a model that answers in DocTags (SmolDocling, Granite-Docling): the answer "
        "as its raw DocTags, or converted by docling-core (pip install 'mlxvlm[docs]') to "
        "Markdown, HTML or Docling's JSON; printed once whole (default: the answer's text "
        "as it streams)",
    )
    parser.add_argument(
        "--fps", type=ranged(Range(float, 0, 1000, low_open=True)), default=None,
        help="Video frames sampled per second (default: the model's own rate, else "
        f"{DEFAULT_FPS:g}); which frames: as the model's transformers processor picks them",
    )
    parser.add_argument(
        "--max-frames", type=ranged(at_least(1)), default=DEFAULT_MAX_FRAMES,
        help="Most frames per video",
    )


def _page_spec(text: str) -> str:
    from mlxvlm.media.pdf import parse_page_spec

    try:
        parse_page_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


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

    from mlxvlm.generate.pdf_pages import open_cli_pdf
    from mlxvlm.media.pdf import looks_like_pdf

    policy = cli_media_policy()
    loaded = []
    for kind, source in args.media or []:
        if kind == "pdf" or (kind == "image" and looks_like_pdf(source)):
            loaded.append(("pdf", open_cli_pdf(source, args, policy)))
            continue
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


def build_parser() -> argparse.ArgumentParser:
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
    add_speech_arguments(parser)
    parser.add_argument(
        "--verbose", action="store_true",
        help="Print statistics, backend details and where the sampling values came from to "
        "stderr (under mlx.launch: what each rank holds)",
    )
    return parser


def add_speech_arguments(parser: argparse.ArgumentParser) -> None:
    from mlxvlm.generate.speech import DEFAULT_MAX_FRAMES

    parser.add_argument(
        "--audio-output", default=None, metavar="OUT.wav",
        help="Also speak the answer (a model with a talker: Qwen3-Omni's full checkpoint) "
        "into this WAV file (16-bit PCM, mono, at the model's rate)",
    )
    parser.add_argument(
        "--voice", default=None,
        help="The voice, as the checkpoint names its speakers (any case; default: the "
        "model's, Ethan for Qwen3-Omni); with --audio-output",
    )
    parser.add_argument(
        "--talker-temperature", type=ranged(Range(float, 0, 100)), default=None,
        help="The talker's sampling temperature (0: argmax for the talker and its code "
        "predictor, no repetition penalty; default: the checkpoint's own sampling, "
        "temperature 0.9, top-k 50, repetition penalty 1.05); with --audio-output",
    )
    parser.add_argument(
        "--talker-max-frames", type=ranged(at_least(1)), default=DEFAULT_MAX_FRAMES,
        help="The most codec frames spoken (Qwen3-Omni: 12.5 per second of audio); with "
        "--audio-output",
    )


def _speech_request(args: argparse.Namespace):
    """The speech flags as a SpeechRequest; None without --audio-output (and then the
    other speech flags are refused)."""
    from mlxvlm.errors import MlxvlmError
    from mlxvlm.generate.speech import SpeechRequest

    request = SpeechRequest(args.voice, args.talker_temperature, args.talker_max_frames)
    if args.audio_output is None:
        if request != SpeechRequest():
            raise MlxvlmError("--voice, --talker-temperature and --talker-max-frames need "
                              "--audio-output")
        return None
    return request


def _prompt_text(args: argparse.Namespace) -> str:
    if args.prompt == "-":
        return sys.stdin.read()
    if args.prompt is not None:
        return args.prompt
    kinds = [kind for kind, _ in args.media or []]
    # A PDF's pages reach the model as images.
    return f"Describe this {kinds[0].replace('pdf', 'image')}." if kinds else "Hello"


def _user_turn(text: str, media: list[tuple[str, object]]) -> list[dict]:
    """One user turn: the decoded media in command-line order, then the text."""
    content = [{"type": kind, kind: value} for kind, value in media]
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    def body() -> int:
        if launched_rank() != 0:  # rank 0 prints the answer; this rank follows it
            from mlxvlm.distributed.rank_stop import say_error, watched_run
            from mlxvlm.generate.follower import follow

            model, processor = sharded_load(args)
            with watched_run(model, say_error):  # (a rank 0 gone ends this one)
                follow(model, processor)
            return 0
        _generate_on_rank0(args)
        return 0

    return run_cli(body)


def _generate_on_rank0(args: argparse.Namespace) -> None:
    """The CLI's work alone or on rank 0: media, model, the answer printed."""
    from mlxvlm.generate.pdf_pages import check_pdf_arguments, close_pdfs

    # Read the media first: a bad path should fail before a slow model load.
    media = load_cli_media(args, verbose=args.verbose)
    try:
        check_pdf_arguments(args, media)
        _load_and_answer(args, media)
    finally:
        close_pdfs(media)


def _load_and_answer(args: argparse.Namespace, media) -> None:
    import mlx.core as mx

    from mlxvlm.cpu import ops

    if args.verbose:
        print(f"[mlxvlm] device: {mx.default_device()}", file=sys.stderr)
        for what, status in ops.process_status():
            print(f"[mlxvlm] {what}: {status}", file=sys.stderr)
    from mlxvlm.distributed.jobs import release
    from mlxvlm.distributed.rank_stop import end_mid_answer, say_error, watched_run

    model, processor = sharded_load(args)
    # Sharded, a rank gone (or a signal inside a collective that waits for it forever)
    # ends this one at once, saying so.
    with watched_run(model, say_error, signals=True):
        try:
            _answer(args, model, processor, media)
        except (KeyboardInterrupt, OSError) as error:
            if model.sharding is None:
                raise
            # Mid-answer, where these come (Ctrl-C, the output's reader gone), the other
            # ranks wait inside the answer's collectives, which a release would not match
            # (seen: a rank crashed on it): this rank ends at once (its exit would wait on
            # those collectives), and they see it gone.
            end_mid_answer(error)
        except BaseException:  # (a user's error, before the answer: they take a release)
            release(model)
            raise
        release(model)  # the other ranks return


def _answer(args: argparse.Namespace, model, processor, media) -> None:
    import mlx.core as mx

    from mlxvlm.cpu import ops

    media = sample_cli_videos(media, args, processor, verbose=args.verbose)
    draft = None
    if args.draft_model is not None:
        from mlxvlm.generate.drafters import load_draft

        draft = load_draft(args.draft_model, processor)
    if args.verbose:
        from mlxvlm.checkpoint.disk_tables import describe as describe_disk_tables

        if (on_disk := describe_disk_tables(model)) is not None:
            print(f"[mlxvlm] embedding tables: {on_disk}", file=sys.stderr)
        if model.cpu_fast_paths is not None:
            print(f"[mlxvlm] CPU fast paths: {model.cpu_fast_paths.describe()}", file=sys.stderr)
        if mx.default_device() == mx.cpu:
            print(f"[mlxvlm] CPU kernels: {ops.kernels_status()}", file=sys.stderr)
            print("[mlxvlm] compute dtype: float32 (fastest on the CPU backend)", file=sys.stderr)
    if args.verbose:
        from mlxvlm.sampling.defaults import resolve
        from mlxvlm.text.tokenization import processor_state

        given = {name: getattr(args, name) for name in
                 ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        chosen = resolve(given, processor_state(processor).sampling_defaults)
        print(f"[mlxvlm] sampling: {chosen.describe()}", file=sys.stderr)
    from mlxvlm.generate.pdf_pages import answer_pages

    sampling = _sampling_options(args, processor)
    speech = _speech_request(args)
    if speech is not None:
        _answer_aloud(args, model, processor, media, draft, speech, sampling)
        return
    if any(kind == "pdf" for kind, _ in media):
        text = _prompt_text(args)
        answer_pages(args, media, lambda pieces: _stream(
            args, model, processor, _user_turn(text, pieces), draft, sampling),
            report=_print_statistics if args.verbose else None,
            convert=_converter(args))
        return
    steps = _stream(args, model, processor, _user_turn(_prompt_text(args), media), draft, sampling)
    last = None
    if args.output_format is None:
        for last in steps:
            print(last.text, end="", flush=True)
        print()
    else:  # converted whole
        pieces = []
        for last in steps:
            pieces.append(last.text)
        images = [value for kind, value in media if kind == "image"]
        print(_converter(args)("".join(pieces), images[0] if len(images) == 1 else None))
    if args.verbose and last is not None:
        _print_statistics(last)


def _answer_aloud(args: argparse.Namespace, model, processor, media, draft, request,
                  sampling) -> None:
    """The answer printed as it is written and spoken meanwhile (the talker follows the
    thinker), into --audio-output."""
    from mlxvlm.errors import MlxvlmError
    from mlxvlm.generate.speech import check_speech_request
    from mlxvlm.speech.wav import write_wav

    if any(kind == "pdf" for kind, _ in media):
        raise MlxvlmError("--audio-output speaks one answer: it does not take a PDF")
    check_speech_request(model, request, {"draft_model": draft,
                                          "prompt_lookup_num_tokens": args.prompt_lookup_num_tokens,
                                          "mtp": args.mtp or None})
    last = speech = None
    for result in _stream(args, model, processor, _user_turn(_prompt_text(args), media), draft,
                          sampling, audio_output=True, voice=request.voice,
                          talker_temperature=request.talker_temperature,
                          talker_max_frames=request.talker_max_frames):
        if result.token is None:  # a chunk of the speech
            speech = result.speech or speech
            continue
        last = result
        print(result.text, end="", flush=True)
    print()
    if speech is None:
        return
    write_wav(args.audio_output, speech.audio, speech.sample_rate)
    if args.verbose:
        _print_statistics(last)
        _print_speech_statistics(speech, speech.first_audio_seconds)


def _print_speech_statistics(speech, first_audio: float | None) -> None:
    seconds = speech.audio_seconds
    factor = f"{speech.seconds / seconds:.2f}" if seconds else "n/a (no audio)"
    first = f"{first_audio:.2f} s" if first_audio is not None else "n/a (no audio)"
    print(
        f"[mlxvlm] speech: {len(speech.codes)} frames, {seconds:.2f} s of audio at "
        f"{speech.sample_rate} Hz, voice {speech.voice}\n"
        f"[mlxvlm] time to first audio: {first} (from the start of the answer)\n"
        f"[mlxvlm] real-time factor: {factor} (talker and codec seconds per second of "
        f"audio; below 1 is faster than real time)",
        file=sys.stderr,
    )


def _sampling_options(args: argparse.Namespace, processor):
    """The command line's sampling options (those left out: the checkpoint's); with
    --output-format, DocTags' tags kept in the answer's text."""
    from mlxvlm.generate.stream import sampling_options

    options = sampling_options(
        processor,
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
    )
    if args.output_format is not None:
        from mlxvlm.text.doctags import check_answers_in_doctags, doctags_token_ids

        check_answers_in_doctags(processor, args.output_format, "--output-format")
        options.kept_token_ids = options.kept_token_ids | doctags_token_ids(processor)
    return options


def _converter(args: argparse.Namespace):
    """(answer, page image or None) -> what --output-format asks for; None without it."""
    if args.output_format is None:
        return None
    from mlxvlm.text.doctags import convert

    return lambda answer, image: convert(answer.strip(), args.output_format, image)


def _stream(args: argparse.Namespace, model, processor, messages: list[dict], draft, sampling,
            **speech):
    """stream_generate over ``messages`` with the command line's options (``speech``: its
    audio_output keywords)."""
    from mlxvlm.generate import CacheOptions, SpeculationOptions, stream_generate

    return stream_generate(
        model,
        processor,
        messages,
        system=args.system,
        sampling=sampling,
        cache=CacheOptions(args.max_kv_size, args.kv_bits, args.kv_group_size,
                           args.quantized_kv_start),
        prefill_step_size=args.prefill_step_size,
        speculation=SpeculationOptions(draft, args.num_draft_tokens,
                                       args.prompt_lookup_num_tokens, args.mtp),
        **speech,
    )


def _print_statistics(last) -> None:
    print(
        f"[mlxvlm] prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens/s\n"
        f"[mlxvlm] generation: {last.generation_tokens} tokens, "
        f"{last.generation_tps:.1f} tokens/s ({last.finish_reason})\n"
        f"[mlxvlm] peak memory: {last.peak_memory:.3f} GB",
        file=sys.stderr,
    )
    if last.speculation is not None:
        print(f"[mlxvlm] speculation: {last.speculation.describe()}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
