"""Qwen3-Omni's speech stages: time to first audio, real-time factor and peak memory of the
talker (with its code predictor) and code2wav, mlxvlm against transformers.

    python benchmarks/omni_speech.py                        # 6 experts, 48 frames
    python benchmarks/omni_speech.py --experts 128 --frames 125 --output r.json
    python benchmarks/omni_speech.py --engines mlxvlm --weights float32 bfloat16 q8 q4 --rounds 2
    python benchmarks/omni_speech.py --engines mlxvlm --weights float32 q4 --talker-only
    python benchmarks/omni_speech.py --weights bfloat16 --talker-only --speakers 1 2 4 --rounds 2

The talker and codec have Qwen/Qwen3-Omni-30B-A3B-Instruct's shapes (its config.json:
a 20-layer 1024-wide MoE talker, 6 of its experts per token with a shared expert, 16
heads over 2 KV heads; a 5-layer 1024-wide code predictor for the other 15 of 16 code
groups; code2wav's 8-layer transformer and 1920x upsampling decoder) with random weights
(bfloat16 on disk, float32 compute on both engines), built once under
``benchmarks/checkpoints/``: transformers' init with the talker's expert banks and
routers drawn and its end-of-speech row zeroed (``checkpoints.speaks_until_stopped``), so
that it speaks every frame asked. ``--experts`` keeps fewer of the 128 experts (at least the 6
a token uses): a token's work is the same (6 experts of 384), only memory shrinks (128
experts in float32 are 12 GB; with 6, both engines hold about 2.5 GB).
The thinker (30B) is left out: the talker is given random conditioning of the thinker's
width (a ``--prompt``-position prefill, one text row per frame), as both engines take it.

``--weights`` sets mlxvlm's talker weights (its code predictor with it), made as
``load`` makes them from a converted checkpoint: float32; bfloat16 (``python -m
mlxvlm.convert --dtype bfloat16``: on the CPU the linear and embedding weights stay 16-bit
and compute in float32, the rest is cast to float32); q8 or q4 (affine, group size 64,
quantized from the bfloat16 weights as ``python -m mlxvlm.convert -q`` does, through its
module choice, ``checkpoint.quantization.conversion_predicate``). Then the loader's CPU
rewrite (``cpu.ops.apply_cpu_fast_paths``: 16-bit and quantized layers, norms and
rotary embeddings on mlxvlm's kernels) unless ``--no-cpu-fast-paths`` (MLX's own layers,
as this benchmark ran before). code2wav stays float32 in every case (convert never
quantizes it). transformers always runs float32.

Each engine runs in a fresh process, greedy (no repetition penalty) for ``--frames``
frames (12.5 a second of audio). mlxvlm streams: the talker's frames go to code2wav
in chunks (4 frames first, then 24), and its time to first audio is the first chunk's
waveform from the talker's prefill on. transformers has no stream: its first audio is the
whole waveform, after ``generate`` and ``chunked_decode`` (its 300-frame chunks). The
real-time factor is the engine's talker + codec seconds over the audio's seconds (below 1
is faster than real time). Both engines' codes are compared (equal for the frames both
made).

``--speakers N ...``: mlxvlm only, N talkers at once (each its own random conditioning,
its prefill 8 positions longer than the last one's, greedy), prefilled one by one (B=1,
as the engine does), then stepped to their end two ways, alternating run by run: through
``SpeechBatch`` (batched: each step one pass per stage over every talker) and one after
another (serial: each talker's ``AnswerSpeaker.frame`` in turn, as ``SpeechBatch`` did
before). Reported: the aggregate frames per second of the N talkers, the milliseconds
of a step (one frame of every talker: the time between a talker's frames) and whether
both ways spoke the same codes. Prefill excluded; with ``--talker-only`` no codec.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKPOINTS = HERE / "checkpoints"
SAMPLE_RATE = 24000
SEED = 0

TALKER_TEXT = dict(
    vocab_size=3072, hidden_size=1024, intermediate_size=2048, num_hidden_layers=20,
    num_attention_heads=16, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
    num_experts=128, num_experts_per_tok=6, moe_intermediate_size=384,
    shared_expert_intermediate_size=768, norm_topk_prob=True, max_position_embeddings=65536,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                     "mrope_section": [24, 20, 20], "interleaved": True},
)
CODE_PREDICTOR = dict(
    vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    num_code_groups=16, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
TALKER = dict(
    num_code_groups=16, thinker_hidden_size=2048, accept_hidden_layer=24,
    codec_eos_token_id=2150, codec_pad_id=2148, codec_bos_id=2149, codec_nothink_id=2155,
    codec_think_bos_id=2156, codec_think_eos_id=2157, spatial_merge_size=2,
    speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303},
)
CODE2WAV = {}  # transformers' defaults are Qwen3-Omni-30B-A3B's code2wav


def checkpoint_dir(experts: int) -> Path:
    # "-drawn": checkpoints built before the talker's experts were drawn had them as
    # ``torch.empty`` left them (zeros and float32 denormals); a new name leaves them unused
    return CHECKPOINTS / f"qwen3-omni-30b-a3b-speech-e{experts}-drawn"


def build(experts: int) -> Path:
    """transformers' talker and code2wav at the real shapes, random, saved in bf16."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as tm

    from checkpoints import speaks_until_stopped

    out = checkpoint_dir(experts)
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    text = {**TALKER_TEXT, "num_experts": experts}
    config = Qwen3OmniMoeConfig(talker_config={**TALKER, "text_config": text,
                                               "code_predictor_config": CODE_PREDICTOR},
                                code2wav_config=CODE2WAV, enable_audio_output=True)
    state = {}
    with torch.device("cpu"):
        talker = tm.Qwen3OmniMoeTalkerForConditionalGeneration._from_config(
            config.talker_config, dtype=torch.bfloat16)
        speaks_until_stopped(talker, config.talker_config)
        state.update({f"talker.{k}": v.contiguous() for k, v in talker.state_dict().items()})
        del talker
        code2wav = tm.Qwen3OmniMoeCode2Wav._from_config(config.code2wav_config,
                                                         dtype=torch.bfloat16)
        state.update({f"code2wav.{k}": v.contiguous() for k, v in code2wav.state_dict().items()})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    full = config.to_dict()
    (out / "config.json").write_text(json.dumps(
        {"talker_config": full["talker_config"], "code2wav_config": full["code2wav_config"],
         "transformers_version": full.get("transformers_version", "5")}, indent=2))
    return out


def conditioning(prompt: int, frames: int, seed: int = SEED):
    """The thinker's side, random: the talker's prefill, one text row per frame, tts_pad."""
    import numpy as np

    rng = np.random.default_rng(seed)
    width = TALKER_TEXT["hidden_size"]
    prefill = rng.standard_normal((1, prompt, width)).astype(np.float32) * 0.5
    trailing = rng.standard_normal((frames, width)).astype(np.float32) * 0.5
    pad = rng.standard_normal((1, width)).astype(np.float32) * 0.5
    return prefill, trailing, pad


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


WEIGHTS = ("float32", "bfloat16", "q8", "q4")


def prepare_talker(talker, precision: str, fast_paths: bool):
    """The talker as ``load`` leaves it for ``--weights`` (its weights read as float32 for
    float32, else as the checkpoint's bfloat16); what the CPU rewrite did."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlxvlm.checkpoint.quantization import conversion_predicate
    from mlxvlm.cpu import ops

    if precision in ("q8", "q4"):
        # the module paths convert sees (``talker.*``), so that its choice applies as is
        holder = nn.Module()
        holder.talker = talker
        chosen = conversion_predicate(TALKER_TEXT["num_hidden_layers"])
        nn.quantize(holder, group_size=64, bits=int(precision[1:]),
                    class_predicate=lambda path, module: chosen(path, module))
    if precision != "float32":
        ops.cast_to_float32_keeping_half_weights(talker)
    mx.eval(talker.parameters())
    return ops.apply_cpu_fast_paths(talker).describe() if fast_paths else "off"


def load_mlxvlm(directory: Path, precision: str, fast_paths: bool):
    """(talker, code2wav, what the CPU rewrite did, load seconds)."""
    import mlxvlm  # noqa: F401  (first: its CPU set-up runs before MLX loads)
    import mlx.core as mx

    from mlxvlm.cpu import blas

    # MLX loaded before mlxvlm binds its products to its own BLAS: float32 products and
    # convolutions 4-10x slower, figures off without a sign (code2wav 41-54 s, not 4-13)
    if blas.openblas_status.startswith("skipped"):
        raise SystemExit(f"error: mlxvlm's CPU set-up did not run ({blas.openblas_status})")
    from mlxvlm.checkpoint.loading import load_weights_files
    from mlxvlm.models import qwen3_vl_moe
    from mlxvlm.models.layers.qwen3_omni_code2wav import Code2Wav, Code2WavConfig
    from mlxvlm.models.layers.qwen3_omni_talker import Talker, TalkerConfig

    config = json.loads((directory / "config.json").read_text())
    start = time.perf_counter()
    talker_config = TalkerConfig.from_hf(config["talker_config"])
    talker, code2wav = Talker(talker_config), Code2Wav(Code2WavConfig.from_hf(config["code2wav_config"]))
    weights = load_weights_files(directory)
    for name in list(weights):  # one tensor at a time: the bf16 copy goes as it is read
        if precision == "float32" or name.startswith("code2wav."):
            weights[name] = weights[name].astype(mx.float32)
        mx.eval(weights[name])
    # popped: each tensor is held once, by the talker, once it is loaded
    talker_weights = qwen3_vl_moe.split_experts(
        {k[len("talker."):]: weights.pop(k) for k in list(weights) if k.startswith("talker.")},
        talker_config.text, out_in=True)
    talker.load_weights(list(talker_weights.items()), strict=True)
    del talker_weights
    codec_weights = {}
    for name, value in weights.items():
        if name.startswith("code2wav.") and not name.endswith("code_offset"):
            inner = name[len("code2wav."):]
            codec_weights[Code2Wav.hf_to_mlx_name(inner)] = Code2Wav.sanitize(inner, value)
    code2wav.load_weights(list(codec_weights.items()), strict=True)
    mx.eval(talker.parameters(), code2wav.parameters())
    del weights
    cpu_paths = prepare_talker(talker, precision, fast_paths)
    return talker, code2wav, cpu_paths, time.perf_counter() - start


def run_mlxvlm(directory: Path, prompt: int, frames: int, precision: str = "float32",
               fast_paths: bool = True, codec_too: bool = True) -> dict:
    import mlx.core as mx
    import numpy as np

    from mlxvlm.speech import talker as talker_stream
    from mlxvlm.speech.codec import CodecStream
    from mlxvlm.speech.talker import TalkerSampling, TalkerStream

    talker, code2wav, cpu_paths, load_seconds = load_mlxvlm(directory, precision, fast_paths)
    prefill, trailing, pad = conditioning(prompt, frames)
    stream = TalkerStream(talker, TalkerSampling(temperature=0.0, max_frames=frames))
    stream.add_text(mx.array(trailing))
    stream.end_text(mx.array(pad))
    # the code predictor's share of a frame (its 15 passes end in .tolist(): timed whole)
    predictor = {"seconds": 0.0}
    residual_codes = talker_stream._residual_codes

    def timed_residual_codes(*args):
        t = time.perf_counter()
        result = residual_codes(*args)
        predictor["seconds"] += time.perf_counter() - t
        return result

    talker_stream._residual_codes = timed_residual_codes
    codec = CodecStream(code2wav)
    mx.reset_peak_memory()
    started = time.perf_counter()
    first_audio = None
    chunks, codes = [], []
    talker_seconds = codec_seconds = 0.0
    positions = mx.broadcast_to(mx.arange(prompt, dtype=mx.int32), (3, prompt))
    stream.prefill(mx.array(prefill), positions)
    prefill_seconds = time.perf_counter() - started
    talker_seconds += prefill_seconds
    while True:
        t = time.perf_counter()
        frame = stream.step()
        talker_seconds += time.perf_counter() - t
        t = time.perf_counter()
        if not codec_too:
            chunk = None
        else:
            chunk = codec.push(frame) if frame is not None else codec.flush()
        if chunk is not None:
            chunks.append(chunk)
            if first_audio is None:
                first_audio = time.perf_counter() - started
        codec_seconds += time.perf_counter() - t
        if frame is None:
            break
        codes.append(frame)
    total = time.perf_counter() - started
    audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    return dict(engine="mlxvlm", weights=precision, cpu_paths=cpu_paths,
                load_seconds=load_seconds,
                frames=len(codes), predictor_seconds=predictor["seconds"],
                prefill_seconds=prefill_seconds,
                audio_seconds=len(audio) / SAMPLE_RATE, first_audio_seconds=first_audio,
                talker_seconds=talker_seconds, codec_seconds=codec_seconds, total_seconds=total,
                peak_rss_gb=peak_rss_gb(), mlx_peak_gb=mx.get_peak_memory() / 1e9,
                codes=np.stack(codes).tolist() if codes else [])


def run_speakers(directory: Path, prompt: int, frames: int, precision: str, fast_paths: bool,
                 codec_too: bool, speakers: int, batched: bool) -> dict:
    """``speakers`` talkers prefilled one by one, then stepped to their end together
    (``SpeechBatch``) or one after another (each ``AnswerSpeaker.frame`` in turn)."""
    import mlx.core as mx
    import numpy as np

    from mlxvlm.speech.codec import CodecStream
    from mlxvlm.speech.pipeline import AnswerSpeaker, Speech
    from mlxvlm.speech.speech_batch import SpeechBatch
    from mlxvlm.speech.talker import TalkerSampling, TalkerStream

    class Speaker(AnswerSpeaker):
        """An answer's talker and codec without a thinker: its text is given whole."""

        def __init__(self, stream, codec):
            self.talker, self.codec, self.text = stream, codec, None
            self.generated, self.frames = [], []
            self.speech = Speech(np.zeros(0, np.float32), SAMPLE_RATE,
                                 np.zeros((0, TALKER["num_code_groups"]), np.int64), "random")
            self._start = time.perf_counter()

    class NoCodec:
        sample_rate = SAMPLE_RATE

        def push(self, frame):
            return None

        def flush(self):
            return None

    talker, code2wav, cpu_paths, load_seconds = load_mlxvlm(directory, precision, fast_paths)
    mx.reset_peak_memory()
    started = time.perf_counter()
    group = []
    for i in range(speakers):
        prefill, trailing, pad = conditioning(prompt + 8 * i, frames, seed=SEED + i)
        stream = TalkerStream(talker, TalkerSampling(temperature=0.0, max_frames=frames))
        stream.add_text(mx.array(trailing))
        stream.end_text(mx.array(pad))
        length = prefill.shape[1]
        stream.prefill(mx.array(prefill), mx.broadcast_to(mx.arange(length, dtype=mx.int32),
                                                          (3, length)))
        group.append(Speaker(stream, CodecStream(code2wav) if codec_too else NoCodec()))
    prefill_seconds = time.perf_counter() - started
    started = time.perf_counter()
    steps = 0
    if batched:
        batch = SpeechBatch()
        for key, speaker in enumerate(group):
            batch.join(key, speaker)
        while len(batch):
            for key, spoken in batch.step().items():
                if spoken.failure is not None:
                    raise spoken.failure
            steps += 1
    else:
        live = list(group)
        while live:
            for speaker in list(live):
                if speaker.frame() is None:
                    speaker.end()
                    live.remove(speaker)
            steps += 1
    seconds = time.perf_counter() - started
    made = sum(len(speaker.frames) for speaker in group)
    return dict(engine="mlxvlm", weights=precision, cpu_paths=cpu_paths,
                load_seconds=load_seconds, speakers=speakers,
                stepping="batched" if batched else "serial", frames=made, steps=steps,
                prefill_seconds=prefill_seconds, stepping_seconds=seconds,
                frames_per_second=made / seconds, step_ms=1000 * seconds / max(steps, 1),
                peak_rss_gb=peak_rss_gb(), mlx_peak_gb=mx.get_peak_memory() / 1e9,
                codes=[np.stack(speaker.frames).tolist() for speaker in group])


def run_transformers(directory: Path, prompt: int, frames: int) -> dict:
    import numpy as np
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as tm

    saved = json.loads((directory / "config.json").read_text())
    config = Qwen3OmniMoeConfig(talker_config=saved["talker_config"],
                                code2wav_config=saved["code2wav_config"])
    start = time.perf_counter()
    weights = load_file(str(directory / "model.safetensors"))
    talker = tm.Qwen3OmniMoeTalkerForConditionalGeneration._from_config(
        config.talker_config, dtype=torch.float32).eval()
    talker.load_state_dict({k[len("talker."):]: v.float() for k, v in weights.items()
                            if k.startswith("talker.")}, strict=True)
    code2wav = tm.Qwen3OmniMoeCode2Wav._from_config(config.code2wav_config,
                                                    dtype=torch.float32).eval()
    code2wav.load_state_dict({k[len("code2wav."):]: v.float() for k, v in weights.items()
                              if k.startswith("code2wav.")}, strict=True)
    del weights
    load_seconds = time.perf_counter() - start

    prefill, trailing, pad = conditioning(prompt, frames)
    vocab = TALKER_TEXT["vocab_size"]
    eos = TALKER["codec_eos_token_id"]
    torch.set_grad_enabled(False)
    started = time.perf_counter()
    result = talker.generate(
        inputs_embeds=torch.from_numpy(prefill), trailing_text_hidden=torch.from_numpy(trailing)[None],
        tts_pad_embed=torch.from_numpy(pad)[None],
        talker_input_ids=torch.zeros((1, prompt), dtype=torch.long),
        attention_mask=torch.ones((1, prompt), dtype=torch.long), max_new_tokens=frames + 1,
        do_sample=False, repetition_penalty=1.0, eos_token_id=eos,
        suppress_tokens=[i for i in range(vocab - 1024, vocab) if i != eos],
        output_hidden_states=True, return_dict_in_generate=True)
    codes = torch.stack([h[-1] for h in result.hidden_states if h[-1] is not None], dim=1)
    codes = codes.transpose(1, 2)
    talker_seconds = time.perf_counter() - started
    t = time.perf_counter()
    wav = code2wav.chunked_decode(codes, chunk_size=300, left_context_size=25)
    codec_seconds = time.perf_counter() - t
    total = time.perf_counter() - started
    return dict(engine="transformers", load_seconds=load_seconds, frames=int(codes.shape[-1]),
                audio_seconds=wav.shape[-1] / SAMPLE_RATE, first_audio_seconds=total,
                talker_seconds=talker_seconds, codec_seconds=codec_seconds, total_seconds=total,
                peak_rss_gb=peak_rss_gb(), codes=codes[0].T.numpy().tolist())


def run_child(engine: str, args, precision: str, speakers: list[str] = ()) -> dict:
    child = subprocess.run([sys.executable, __file__, "--engine", engine, "--experts",
                            str(args.experts), "--frames", str(args.frames), "--prompt",
                            str(args.prompt), "--weights", precision, *speakers,
                            *(["--no-cpu-fast-paths"] if args.no_cpu_fast_paths else []),
                            *(["--talker-only"] if args.talker_only else [])],
                           capture_output=True, text=True, check=True)
    result = json.loads(child.stdout.strip().splitlines()[-1])
    result["load_average"] = os.getloadavg()[0]
    return result


def speakers_main(args) -> int:
    """``--speakers``: batched and serial stepping alternated run by run, each size."""
    runs = [(n, stepping) for n in args.speakers for stepping in ("serial", "batched")]
    results = [run_child("mlxvlm", args, args.weights[0],
                         ["--speakers", str(n), "--stepping", stepping])
               for _ in range(args.rounds) for n, stepping in runs]
    serial_codes = {r["speakers"]: r["codes"] for r in results if r["stepping"] == "serial"}
    for r in results:
        r["same_codes_as_serial"] = r["codes"] == serial_codes[r["speakers"]]
        print(f"{r['speakers']} talkers {r['stepping']:>7} ({r['weights']}): {r['frames']} "
              f"frames in {r['steps']} steps, {r['frames_per_second']:.1f} frames/s, "
              f"{r['step_ms']:.0f} ms a step; prefill {r['prefill_seconds']:.2f} s; peak RSS "
              f"{r['peak_rss_gb']:.2f} GB; load average {r['load_average']:.2f}; codes as "
              f"serial's: {r['same_codes_as_serial']}")
    if args.output:
        for r in results:
            r.pop("codes")
        settings = {k: v for k, v in vars(args).items()
                    if k not in ("engine", "engines", "output", "stepping")}
        Path(args.output).write_text(json.dumps(dict(settings, results=results), indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=6)
    parser.add_argument("--frames", type=int, default=48)
    parser.add_argument("--prompt", type=int, default=64, help="talker prefill positions")
    parser.add_argument("--engines", nargs="+", default=["mlxvlm", "transformers"])
    parser.add_argument("--weights", nargs="+", choices=WEIGHTS, default=["float32"],
                        help="mlxvlm's talker weights; several are run in turn")
    parser.add_argument("--no-cpu-fast-paths", action="store_true",
                        help="mlxvlm's talker on MLX's own layers (no loader CPU rewrite)")
    parser.add_argument("--talker-only", action="store_true",
                        help="mlxvlm: the talker's frames without code2wav (no audio)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each engine and weights, alternating round by round")
    parser.add_argument("--speakers", type=int, nargs="+", default=None,
                        help="mlxvlm: this many talkers stepped together through "
                             "SpeechBatch and one after another, alternating")
    parser.add_argument("--stepping", choices=("batched", "serial"), help=argparse.SUPPRESS)
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    directory = checkpoint_dir(args.experts)
    if args.engine is not None:
        if args.engine == "mlxvlm":
            import mlxvlm  # noqa: F401  (before the runs import MLX: see load_mlxvlm)
        if args.speakers:
            result = run_speakers(directory, args.prompt, args.frames, args.weights[0],
                                  not args.no_cpu_fast_paths, not args.talker_only,
                                  args.speakers[0], args.stepping == "batched")
        elif args.engine == "mlxvlm":
            result = run_mlxvlm(directory, args.prompt, args.frames, args.weights[0],
                                not args.no_cpu_fast_paths, not args.talker_only)
        else:
            result = run_transformers(directory, args.prompt, args.frames)
        print(json.dumps(result))
        return 0
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); "
                    f"import omni_speech; omni_speech.build({args.experts})"], check=True)
    if args.speakers:
        return speakers_main(args)
    runs = [(engine, precision) for engine in args.engines
            for precision in (args.weights if engine == "mlxvlm" else ["float32"])]
    results = [run_child(engine, args, precision)
               for _ in range(args.rounds) for engine, precision in runs]
    reference = next((r["codes"] for r in results if r.get("weights") == "float32"), None)
    for r in results:
        factor = (r["talker_seconds"] + r["codec_seconds"]) / r["audio_seconds"] if r["audio_seconds"] else float("nan")
        frames = max(r["frames"], 1)
        predictor = r.get("predictor_seconds")
        split = "" if predictor is None else (
            f" (prefill {r['prefill_seconds']:.2f} s; a frame after it "
            f"{1000 * (r['talker_seconds'] - r['prefill_seconds']) / frames:.0f} ms, of which "
            f"the code predictor {1000 * predictor / frames:.0f})")
        same = ""
        if reference is not None:
            n = min(len(reference), len(r["codes"]))
            equal = sum(a == b for a, b in zip(reference[:n], r["codes"][:n]))
            same = f"; {equal}/{n} frames as float32's"
        first = r["first_audio_seconds"]  # None: the codec was left out
        first = "-" if first is None else f"{first:.2f}"
        print(f"{r['engine']:>12} {r.get('weights', 'float32'):>8}: {r['frames']} frames, "
              f"{r['audio_seconds']:.2f} s audio; first audio {first} s; "
              f"talker {1000 * r['talker_seconds'] / frames:.0f} ms/frame{split}; codec "
              f"{r['codec_seconds']:.2f} s; real-time factor {factor:.2f}; peak RSS "
              f"{r['peak_rss_gb']:.2f} GB; load {r['load_seconds']:.1f} s; load average "
              f"{r['load_average']:.1f}{same}")
    if args.output:
        for r in results:
            r.pop("codes")
        settings = {k: v for k, v in vars(args).items() if k not in ("engine", "output")}
        Path(args.output).write_text(json.dumps(dict(settings, results=results), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
