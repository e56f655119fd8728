"""Qwen2.5-Omni's speech stages: the talker's seconds per code, token2wav's seconds (its
DiT's ten ODE steps, then BigVGAN), the real-time factor and peak memory, mlxvlm against
transformers, at Qwen/Qwen2.5-Omni-7B's widths.

    python benchmarks/qwen2_5_omni_speech.py                    # 4 talker layers, 50 codes
    python benchmarks/qwen2_5_omni_speech.py --talker-layers 24 --codes 250 --output r.json

The shapes (random weights, bfloat16 on disk, float32 compute on both engines, built once
under ``benchmarks/checkpoints/``): the talker 896 wide (12 heads of 128 over 4 KV heads,
MLP 18944, M-RoPE sections 16/24/24) reading rows of the thinker's 3584, an 8448-entry
codec vocabulary, of its 24 layers ``--talker-layers``; token2wav whole, at transformers'
defaults (which are the 7B's): the 22-block 1024-wide DiT with its ECAPA speaker encoder
over an 80-bin mel, and BigVGAN (1536 channels, 240x upsampling). A code is 480 samples:
50 codes a second. The talker's widths are those of the 7B's published config.json
(``talker_config``: hidden_size, head_dim, intermediate_size and embedding_size as
copies of it on the Hub show them; heads, KV heads, layers and sections as other
engines' Qwen2.5-Omni ports read them), not transformers' talker defaults (3584 wide).
The thinker is left out: the talker is given random rows of its width (a ``--prompt``-row
prefill, one text row per code), as both engines take them; the voice is random too.

Each engine runs in a fresh process: the talker greedy (no repetition penalty, kept to
the codes token2wav decodes, so that it ends only at ``--codes``), then token2wav over
its codes from the same noise. transformers' talker
is driven through its forward step by step with the attention mask (its ``generate``
drops an all-ones mask, and its talker then leaves out the codec embeddings it prepares). Both engines' codes and waveforms are compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKPOINTS = HERE / "checkpoints"
SEED = 0
SAMPLE_RATE = 24000
MEL_DIM = 80
REFERENCE_FRAMES = 300

TALKER = dict(
    vocab_size=8448, embedding_size=3584, hidden_size=896, intermediate_size=18944,
    num_attention_heads=12, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                     "mrope_section": [16, 24, 24]},
    tts_codec_start_token_id=8293, tts_codec_end_token_id=8294, tts_codec_pad_token_id=8292,
    tts_codec_mask_token_id=8296,
)
TOKEN2WAV: dict = {}  # transformers' defaults: the 7B's DiT and BigVGAN
# token2wav's codebook (the DiT's num_embeds): the random talker is kept below it on both
# engines, as the trained one speaks no other code before its end (codec_bos, pad and
# end are above it, so the talker runs to --codes)
DECODABLE = 8193


def checkpoint_dir(layers: int) -> Path:
    # named by the talker's shapes too, so that a checkpoint built at other widths is
    # never reused
    shapes = hashlib.sha256(json.dumps(TALKER, sort_keys=True).encode()).hexdigest()[:8]
    return CHECKPOINTS / f"qwen2.5-omni-7b-speech-l{layers}-{shapes}"


def build(layers: int) -> Path:
    """transformers' talker and token2wav at the 7B's widths, random, saved in bf16."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2_5OmniConfig
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as tm

    out = checkpoint_dir(layers)
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    config = Qwen2_5OmniConfig(talker_config={**TALKER, "num_hidden_layers": layers},
                               token2wav_config=TOKEN2WAV, enable_audio_output=True)
    state = {}
    with torch.device("cpu"):
        talker = tm.Qwen2_5OmniTalkerForConditionalGeneration._from_config(
            config.talker_config, dtype=torch.bfloat16)
        state.update({f"talker.{k}": v.contiguous() for k, v in talker.state_dict().items()})
        del talker
        token2wav = tm.Qwen2_5OmniToken2WavModel._from_config(config.token2wav_config,
                                                              dtype=torch.bfloat16)
        for name, param in token2wav.named_parameters():  # the snakes off their zero init
            if name.endswith((".alpha", ".beta")):
                param.data.normal_(0, 0.3)
        state.update({f"token2wav.{k}": v.contiguous() for k, v in token2wav.state_dict().items()})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    full = config.to_dict()
    (out / "config.json").write_text(json.dumps(
        {"talker_config": full["talker_config"], "token2wav_config": full["token2wav_config"]},
        indent=2))
    return out


def inputs(prompt: int, codes: int):
    """The thinker's side and the voice, random: the prefill rows, one text row per code,
    the pad row, the voice's conditioning and reference mel, token2wav's noise."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    width = TALKER["embedding_size"]

    def rows(n):
        return (rng.standard_normal((n, width)) * 0.5).astype(np.float32)

    return dict(prefill=rows(prompt)[None], trailing=rows(codes), pad=rows(1),
                cond=rng.standard_normal((1, 192)).astype(np.float32),
                ref_mel=(rng.standard_normal((1, REFERENCE_FRAMES, MEL_DIM)) - 4).astype(np.float32),
                noise=rng.standard_normal((1, 2 * codes, MEL_DIM)).astype(np.float32))


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def run_mlxvlm(directory: Path, prompt: int, codes: int) -> dict:
    import mlxvlm  # noqa: F401  (first: its CPU set-up runs before MLX loads)
    import mlx.core as mx
    import numpy as np

    from mlxvlm.checkpoint.loading import load_weights_files
    from mlxvlm.models.layers.qwen2_5_omni_talker import Talker, TalkerConfig
    from mlxvlm.models.layers.qwen2_5_omni_token2wav import Token2Wav, Token2WavConfig
    from mlxvlm.speech.qwen2_5_omni_talker import TalkerStream
    from mlxvlm.speech.talker import TalkerSampling

    config = json.loads((directory / "config.json").read_text())
    start = time.perf_counter()
    talker = Talker(TalkerConfig.from_hf(config["talker_config"]))
    token2wav = Token2Wav(Token2WavConfig.from_hf(config["token2wav_config"]))
    weights = load_weights_files(directory)
    talker_weights, codec_weights = [], []
    for name in list(weights):
        value = weights.pop(name).astype(mx.float32)
        mx.eval(value)
        if name.startswith("talker.") and not name.endswith("inv_freq"):
            talker_weights.append((name[len("talker."):], value))
        elif name.startswith("token2wav."):
            value = Token2Wav.sanitize(name[len("token2wav."):], value)
            if value is not None:
                codec_weights.append((name[len("token2wav."):], value))
    talker.load_weights(talker_weights, strict=True)
    token2wav.load_weights(codec_weights, strict=True)
    mx.eval(talker.parameters(), token2wav.parameters())
    load_seconds = time.perf_counter() - start

    class DecodableCodes:
        """The talker, its logits past token2wav's codebook left out."""

        def __init__(self, talker):
            self.talker, self.config, self.model = talker, talker.config, talker.model
            self.outside = mx.array(np.where(np.arange(TALKER["vocab_size"]) < DECODABLE,
                                             0.0, -np.inf).astype(np.float32))

        def __call__(self, rows, positions, cache):
            return self.talker(rows, positions, cache) + self.outside

    data = inputs(prompt, codes)
    stream = TalkerStream(DecodableCodes(talker),
                          TalkerSampling(temperature=0.0, max_frames=codes))
    stream.add_text(mx.array(data["trailing"]))
    stream.end_text(mx.array(data["pad"]))
    mx.reset_peak_memory()
    started = time.perf_counter()
    stream.prefill(mx.array(data["prefill"]),
                   mx.broadcast_to(mx.arange(prompt, dtype=mx.int32), (3, prompt)))
    spoken = []
    while (code := stream.step()) is not None:
        spoken.append(int(code))
    talker_seconds = time.perf_counter() - started
    t = time.perf_counter()
    wav = token2wav(mx.array([spoken]), mx.array(data["cond"]), mx.array(data["ref_mel"]),
                    mx.array(data["noise"][:, : 2 * len(spoken)]))
    wav = np.asarray(wav[0])
    codec_seconds = time.perf_counter() - t
    return dict(engine="mlxvlm", load_seconds=load_seconds, codes=spoken,
                audio_seconds=len(wav) / SAMPLE_RATE, talker_seconds=talker_seconds,
                codec_seconds=codec_seconds, peak_rss_gb=peak_rss_gb(),
                mlx_peak_gb=mx.get_peak_memory() / 1e9, wav=wav.tolist())


def run_transformers(directory: Path, prompt: int, codes: int) -> dict:
    import numpy as np
    import torch
    from safetensors.torch import load_file
    from transformers import DynamicCache, Qwen2_5OmniConfig
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as tm

    saved = json.loads((directory / "config.json").read_text())
    config = Qwen2_5OmniConfig(talker_config=saved["talker_config"],
                               token2wav_config=saved["token2wav_config"])
    start = time.perf_counter()
    weights = load_file(str(directory / "model.safetensors"))
    talker = tm.Qwen2_5OmniTalkerForConditionalGeneration._from_config(
        config.talker_config, dtype=torch.float32).eval()
    talker.load_state_dict({k[len("talker."):]: v.float() for k, v in weights.items()
                            if k.startswith("talker.")}, strict=True)
    token2wav = tm.Qwen2_5OmniToken2WavModel._from_config(config.token2wav_config,
                                                          dtype=torch.float32).eval()
    token2wav.load_state_dict({k[len("token2wav."):]: v.float() for k, v in weights.items()
                               if k.startswith("token2wav.")}, strict=True)
    del weights
    load_seconds = time.perf_counter() - start

    data = {k: torch.from_numpy(v) for k, v in inputs(prompt, codes).items()}
    torch.set_grad_enabled(False)
    ends = (TALKER["tts_codec_pad_token_id"], TALKER["tts_codec_end_token_id"])
    started = time.perf_counter()
    # the talker's forward on the given rows (no ids: plain text positions, no codec
    # embeddings added), then one code per step with the next text row
    cache = DynamicCache(config=talker.config)
    out = talker(inputs_embeds=data["prefill"], thinker_reply_part=torch.cat(
        [data["trailing"], data["pad"]])[None], cache=cache, use_cache=True)
    spoken = []
    while len(spoken) < codes:
        logits = out.logits[:, -1].clone()
        logits[:, DECODABLE:] = -float("inf")  # codec_bos among them
        code = int(logits.argmax(-1))
        if code in ends:
            break
        spoken.append(code)
        if len(spoken) == codes:
            break
        out = talker(input_ids=torch.tensor([[code]]), thinker_reply_part=out.thinker_reply_part,
                     cache=out.cache, use_cache=True)
    talker_seconds = time.perf_counter() - started
    t = time.perf_counter()
    randn = torch.randn
    torch.randn = lambda *shape, **kwargs: data["noise"][:, : 2 * len(spoken)].clone()
    try:
        wav = token2wav(torch.tensor([spoken]), conditioning=data["cond"],
                        reference_mel=data["ref_mel"]).reshape(-1).numpy()
    finally:
        torch.randn = randn
    codec_seconds = time.perf_counter() - t
    return dict(engine="transformers", load_seconds=load_seconds, codes=spoken,
                audio_seconds=len(wav) / SAMPLE_RATE, talker_seconds=talker_seconds,
                codec_seconds=codec_seconds, peak_rss_gb=peak_rss_gb(), wav=wav.tolist())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--talker-layers", type=int, default=4)
    parser.add_argument("--codes", type=int, default=50)
    parser.add_argument("--prompt", type=int, default=64, help="talker prefill rows")
    parser.add_argument("--engines", nargs="+", default=["mlxvlm", "transformers"])
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    directory = checkpoint_dir(args.talker_layers)
    if args.engine is not None:
        run = run_mlxvlm if args.engine == "mlxvlm" else run_transformers
        load_average = os.getloadavg()[0]  # the shared machine's load as this engine starts
        print(json.dumps(dict(run(directory, args.prompt, args.codes),
                              load_average=load_average)))
        return 0
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); "
                    f"import qwen2_5_omni_speech; qwen2_5_omni_speech.build({args.talker_layers})"],
                   check=True)
    results = []
    for engine in args.engines:
        child = subprocess.run([sys.executable, __file__, "--engine", engine, "--talker-layers",
                                str(args.talker_layers), "--codes", str(args.codes), "--prompt",
                                str(args.prompt)], capture_output=True, text=True)
        if child.returncode != 0:
            raise SystemExit(f"{engine} failed:\n{child.stderr[-3000:]}")
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    if len(results) == 2:
        (a, b), (wa, wb) = (r["codes"] for r in results), (r["wav"] for r in results)
        n = min(len(a), len(b))
        print(f"codes equal over the {n} both made: {a[:n] == b[:n]}")
        if a == b:
            import numpy as np

            print(f"waveforms' largest difference: {np.abs(np.array(wa) - np.array(wb)).max():.2e}")
    for r in results:
        seconds = r["talker_seconds"] + r["codec_seconds"]
        factor = seconds / r["audio_seconds"] if r["audio_seconds"] else float("nan")
        print(f"{r['engine']:>12}: {len(r['codes'])} codes, {r['audio_seconds']:.2f} s audio; "
              f"talker {r['talker_seconds']:.2f} s "
              f"({1000 * r['talker_seconds'] / max(len(r['codes']), 1):.0f} ms/code), token2wav "
              f"{r['codec_seconds']:.2f} s; real-time factor {factor:.2f}; peak RSS "
              f"{r['peak_rss_gb']:.2f} GB; load {r['load_seconds']:.1f} s; load average "
              f"{r['load_average']:.2f}")
    if args.output:
        for r in results:
            r.pop("codes"), r.pop("wav")
        settings = {k: v for k, v in vars(args).items() if k not in ("engine", "output")}
        Path(args.output).write_text(json.dumps(dict(settings, results=results), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
