"""Drafting with Qwen3.5's multi-token-prediction head (``--mtp``, ``mtp=True``).

The head against a float32 torch reference written here from the published design
(vLLM's Qwen3.5 MTP module: the normed embedding of the token at i + 1 and the target's
final hidden state at i, concatenated in that order, ``fc``, one full-attention decoder
layer -- transformers' own Qwen3.5 layer with the head's weights --, the final norm and
the shared output head), its chained drafts, greedy output identical with and without it
(dense and MoE, and MiniCPM-V 4.6, whose text model is Qwen3.5's; an image prompt, one and
several draft tokens, a rotating window), sampling that accepts
drafts and leaves the head's cache as a from-scratch run of the head over the answer
builds it, the one-line refusals, and ``convert`` keeping the head (quantized)."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mlxvlm import generate, load, stream_generate
from mlxvlm.errors import MlxvlmError
from tiny import make_image

IMAGE = make_image(112, 84, seed=1)
PROMPT = "Describe this image."
TEXT = "Name three shapes and the colours they have in the picture, please."
NEW = 32


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    loaded = {}

    def get(family):
        if family not in loaded:
            loaded[family] = load(tiny_checkpoints.path(family, "hub"))
        return loaded[family]

    return get


def mtp_tensors(tiny_checkpoints, family) -> dict[str, np.ndarray]:
    path = tiny_checkpoints.path(family, "hub") / "model.safetensors"
    return {k: v for k, v in load_file(str(path)).items() if k.startswith("mtp.")}


class ReferenceHead:
    """The head in float32 torch, over transformers' text model of the tiny checkpoint."""

    def __init__(self, tiny, tensors: dict[str, np.ndarray]):
        import copy

        import torch
        from transformers.models.qwen3_5 import modeling_qwen3_5 as dense
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe

        self.torch = torch
        self.model = tiny.model
        self.text = tiny.model.model.language_model
        config = copy.deepcopy(self.text.config)
        config.layer_types = ["full_attention"]
        module = moe if tiny.family == "qwen3_5_moe" else dense
        prefix = "Qwen3_5Moe" if tiny.family == "qwen3_5_moe" else "Qwen3_5"
        self.layer = getattr(module, f"{prefix}DecoderLayer")(config, 0).float().eval()
        as_torch = {k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}
        layer = {k[len("mtp.layers.0."):]: v for k, v in as_torch.items()
                 if k.startswith("mtp.layers.0.")}
        self.layer.load_state_dict(layer, strict=True)

        def norm(name):
            made = getattr(module, f"{prefix}RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)
            made.weight.data = as_torch[f"mtp.{name}.weight"]
            return made

        self.embedding_norm = norm("pre_fc_norm_embedding")
        self.hidden_norm = norm("pre_fc_norm_hidden")
        self.norm = norm("norm")
        self.fc = as_torch["mtp.fc.weight"]

    def target_hidden(self, ids: list[int]):
        with self.torch.no_grad():
            return self.text(input_ids=self.torch.tensor([ids])).last_hidden_state

    def run(self, next_ids: list[int], hidden):
        """Logits and normed states of the slots 0..n-1 (next tokens ``next_ids``, target
        or chained states ``hidden``), all at once under a causal mask."""
        torch = self.torch
        with torch.no_grad():
            embedded = self.text.embed_tokens(torch.tensor([next_ids]))
            x = torch.cat([self.embedding_norm(embedded), self.hidden_norm(hidden)], dim=-1)
            x = x @ self.fc.T
            n = x.shape[1]
            positions = torch.arange(n)[None, None, :].expand(3, 1, n)
            rotary = self.text.rotary_emb(x, positions)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = self.norm(self.layer(x, position_embeddings=rotary, attention_mask=mask))
            return self.model.lm_head(out), out


def text_ids(processor) -> list[int]:
    return processor.tokenizer(TEXT)["input_ids"]


@pytest.mark.parametrize("family", ("qwen3_5", "qwen3_5_moe"))
def test_the_head_matches_the_reference(models, tiny_checkpoints, family):
    model, processor = models(family)
    reference = ReferenceHead(tiny_checkpoints.model(family), mtp_tensors(tiny_checkpoints, family))
    ids = text_ids(processor)
    assert len(ids) >= 12
    hidden = reference.target_hidden(ids)
    expected, _ = reference.run(ids[1:], hidden[:, :-1])

    target = model.multi_token_predictor()
    ours = target.hidden_states(mx.array([ids]), model.make_cache())
    np.testing.assert_allclose(np.array(ours), hidden.numpy(), atol=1e-4)
    # The head over the slots in two chunks through its KV cache, as prefill runs it.
    cache, split = target.make_cache(), 5
    embedded = target.embed_tokens(mx.array([ids[1:]]))
    parts = [target.step(embedded[:, :split], ours[:, :split], cache, None, 0),
             target.step(embedded[:, split:], ours[:, split:-1], cache, None, split)]
    logits = target.logits(mx.concatenate(parts, axis=1))
    np.testing.assert_allclose(np.array(logits), expected.numpy(), atol=1e-4)


def test_chained_drafts_follow_the_reference(models, tiny_checkpoints):
    """Three greedy drafts: the last committed slot's, then two steps each fed the
    previous step's state and its own token."""
    from mlxvlm.generate.mtp_drafter import MtpDrafter
    from mlxvlm.sampling import SamplingOptions

    family = "qwen3_5"
    model, processor = models(family)
    reference = ReferenceHead(tiny_checkpoints.model(family), mtp_tensors(tiny_checkpoints, family))
    ids = text_ids(processor)
    prompt, next_token = ids[:-1], ids[-1]

    drafter = MtpDrafter(model, SamplingOptions(max_tokens=8))
    cache = model.make_cache()
    drafter.recording(model)(mx.array([prompt[:6]]), cache)  # a prefill chunk
    drafter.recording(model)(mx.array([prompt[6:]]), cache, last_only=True)
    drafter.update(0, next_token)
    drafts, q = drafter.propose(ids, 3)
    assert q is None

    hidden = reference.target_hidden(prompt)
    states, tokens = hidden, ids[1:]
    expected = []
    for _ in range(3):
        logits, out = reference.run(tokens, states)
        top2 = logits[0, -1].topk(2).values
        assert (top2[0] - top2[1]).item() > 1e-3  # a clear choice at float32 rounding
        expected.append(int(logits[0, -1].argmax()))
        states = reference.torch.cat([states, out[:, -1:]], dim=1)
        tokens = tokens + [expected[-1]]
    assert drafts == expected


def run(model, processor, **options):
    results = list(stream_generate(model, processor, PROMPT, IMAGE, **options))
    return [r.token for r in results], results[-1]


@pytest.mark.parametrize("family", ("qwen3_5", "qwen3_5_moe", "minicpmv4_6"))
def test_greedy_output_is_the_same_with_mtp(models, family):
    model, processor = models(family)
    plain, _ = run(model, processor, max_tokens=NEW)
    assert len(plain) >= 12  # the tiny MiniCPM-V ends at EOS after 14
    for k in (1, 3):
        tokens, last = run(model, processor, max_tokens=NEW, mtp=True, num_draft_tokens=k)
        assert tokens == plain
        assert last.speculation.drafted > 0
    # A rotating window with sinks, well past its size (passes of one token there).
    options = dict(max_tokens=NEW + 8, max_kv_size=last.prompt_tokens + 12)
    assert run(model, processor, mtp=True, **options)[0] == run(model, processor, **options)[0]


def test_sampling_accepts_drafts_and_keeps_the_head_cache_exact(models):
    """At temperature 2 the random head's flat drafts meet the tiny target's flat
    distribution often, so passes accept some drafts and reject others; a seed repeats
    the run. The head's cache then holds, slot for slot, what the head computes in one
    pass over the target's states of the whole answer (prompt chunks, kept drafts,
    rejected ones and recurrent re-feeds all committed once, at their positions)."""
    from mlxvlm.generate import CacheOptions
    from mlxvlm.generate.drafters import make_drafter
    from mlxvlm.generate.speculative import SpeculationStats, speculative_tokens
    from mlxvlm.prompt import prepare_inputs
    from mlxvlm.sampling import RowSampler, SamplingOptions

    model, processor = models("qwen3_5")
    inputs = prepare_inputs(processor, PROMPT, IMAGE, feature_names=model.feature_names)
    options = SamplingOptions(max_tokens=NEW, temperature=2.0, seed=3)

    def sample():
        drafter = make_drafter(model, inputs, options, mtp=True, prepare_draft_inputs=None,
                               prefill_step_size=16)
        stats = SpeculationStats()
        tokens = speculative_tokens(
            model, inputs, cache=CacheOptions().make(model, inputs), max_tokens=NEW,
            row=RowSampler(options, inputs.input_ids[0]), options=options, drafter=drafter,
            num_draft_tokens=3, stats=stats, prefill_step_size=16)
        return [token for token, _ in tokens], drafter, stats

    tokens, drafter, stats = sample()
    assert 0 < stats.accepted < stats.drafted
    assert sample()[0] == tokens

    target = model.multi_token_predictor()
    prompt = inputs.input_ids[0].tolist()
    everything = mx.array([prompt + tokens])
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    embeddings = mx.concatenate([embeddings, target.embed_tokens(mx.array([tokens]))], axis=1)
    hidden = target.hidden_states(everything, model.make_cache(), embeddings, state)
    slots = drafter.slots
    assert slots >= len(prompt) + len(tokens) - 4  # committed up to the last verdict
    cache = target.make_cache()
    target.step(embeddings[:, 1 : slots + 1], hidden[:, :slots], cache, state, 0)
    ours = drafter.cache[0]
    assert ours.offset == slots
    for a, b in ((cache[0].keys, ours.keys), (cache[0].values, ours.values)):
        diff = mx.abs(a[..., :slots, :] - b[..., :slots, :]).max().item()
        assert diff < 1e-4


def test_models_without_a_head_are_refused(models, tiny_checkpoints):
    model, processor = models("qwen3_5")
    with pytest.raises(MlxvlmError, match="one drafter"):
        generate(model, processor, PROMPT, IMAGE, max_tokens=4, mtp=True,
                 prompt_lookup_num_tokens=2)
    with pytest.raises(MlxvlmError, match="json_schema"):
        generate(model, processor, PROMPT, IMAGE, max_tokens=4, mtp=True,
                 json_schema={"type": "object"})
    other, other_processor = load(tiny_checkpoints.path("qwen2_vl", "hub"))
    with pytest.raises(MlxvlmError, match="qwen2_vl family has no multi-token-prediction"):
        generate(other, other_processor, PROMPT, IMAGE, max_tokens=4, mtp=True)


@pytest.fixture(scope="module")
def headless(tiny_checkpoints, tmp_path_factory):
    """The Hub checkpoint as an mlx-lm-style conversion leaves it: the config still names
    the head, the weights hold none of it."""
    source = tiny_checkpoints.path("qwen3_5", "hub")
    path = tmp_path_factory.mktemp("headless") / "qwen3_5"
    shutil.copytree(source, path)
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("mtp.")},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((path / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    return path


def test_the_command_line_drafts_with_the_head_and_refuses_a_headless_checkpoint(
        tiny_checkpoints, headless, tmp_path, capsys):
    from mlxvlm.generate.__main__ import main as run_generate_cli

    image = tmp_path / "picture.png"
    IMAGE.save(image)
    args = ["--image", str(image), "--prompt", PROMPT, "--max-tokens", "12"]
    path = str(tiny_checkpoints.path("qwen3_5", "hub"))
    assert run_generate_cli(["--model", path, *args]) == 0
    plain = capsys.readouterr().out
    assert run_generate_cli(["--model", path, *args, "--mtp", "--num-draft-tokens", "2",
                             "--verbose"]) == 0
    out = capsys.readouterr()
    assert out.out == plain
    assert "[mlxvlm] speculation: " in out.err and "drafted tokens accepted" in out.err

    # Loads (the head left out), generates, and refuses --mtp in one line.
    assert run_generate_cli(["--model", str(headless), *args]) == 0
    assert capsys.readouterr().out == plain
    assert run_generate_cli(["--model", str(headless), *args, "--mtp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --mtp given but the checkpoint has no MTP head")


def test_convert_keeps_the_head_quantized(tiny_checkpoints, tmp_path):
    from mlxvlm.convert import convert

    out = tmp_path / "q"
    convert(str(tiny_checkpoints.path("qwen3_5", "hub")), str(out), quantize=True, q_bits=8,
            q_group_size=32)
    names = set(load_file(str(next(out.glob("*.safetensors")))).keys())
    for name in ("language_model.mtp.fc.scales",
                 "language_model.mtp.layers.0.self_attn.q_proj.scales",
                 "language_model.mtp.layers.0.mlp.down_proj.scales",
                 "language_model.mtp.pre_fc_norm_hidden.weight"):
        assert name in names
    model, processor = load(out)
    plain, _ = run(model, processor, max_tokens=16)
    tokens, last = run(model, processor, max_tokens=16, mtp=True, num_draft_tokens=2)
    assert tokens == plain and last.speculation.drafted > 0


def test_the_server_drafts_with_the_head_and_refuses_what_it_cannot(models, tiny_checkpoints,
                                                                    headless):
    """``python -m mlxvlm.server --mtp``: the greedy answer of the server without it;
    refused on a checkpoint without the head."""
    import httpx
    from server_harness import LiveServer
    from server_process import ServerProcess

    from mlxvlm.server.config import ServerConfig

    path = str(tiny_checkpoints.path("qwen3_5", "hub"))
    body = {"model": "q", "messages": [{"role": "user", "content": TEXT}], "max_tokens": 24,
            "temperature": 0.0}

    def ask(server):
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]

    with LiveServer(*models("qwen3_5"), model_id="q", max_concurrency=1) as server:
        plain = ask(server)
    with ServerProcess("--model", path, "--served-model-name", "q", "--max-concurrency", "1",
                       "--mtp", "--num-draft-tokens", "3") as server:
        assert ask(server) == plain
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    drafted = [line for line in metrics.splitlines()
               if line.startswith("mlxvlm_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0
    assert plain["content"] or plain.get("reasoning_content")

    # The entry point's refusal at start (exit 2 with its line) is the service's.
    with pytest.raises(MlxvlmError, match="--mtp given but the checkpoint has no MTP head"):
        LiveServer(*load(headless), model_id="q", max_concurrency=1, mtp=True)
    with pytest.raises(MlxvlmError, match="not both"):
        ServerConfig(model_id="q", max_concurrency=1, mtp=True, prompt_lookup_num_tokens=2)
