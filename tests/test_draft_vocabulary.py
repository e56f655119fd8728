"""A draft model whose embedding table differs from the target's never reads past a
table (MLX's gather does not check its ids): a draft with fewer rows stops drafting once
the target writes an id it lacks, a draft with a larger vocabulary has its drafts cut at
the first id the target lacks -- one sequence, the batching engine's draft batch, and
``python -m mlxvlm.server --draft-model``. Spies on the embedding tables see every id
each model is fed; the answers are the target's plain greedy ones. A draft with another
tokenizer is refused at load; a mere padding difference is not."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from engine_helpers import run_to_end

import mlxvlm
from mlxvlm.batching import BatchEngine, BatchStep, SamplingOptions
from mlxvlm.batching.speculation_rule import SpeculationRule
from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.draft_vocab import embedding_rows
from mlxvlm.generate.speculative import Speculation
from mlxvlm.prompt import prepare_inputs
from parity import user
from tiny import make_image
from user_environment import user_environment

IMAGE = make_image(112, 84, seed=1)
PROMPT = "Describe this image."
NEW = 16
SMALL_ROWS = 365  # below the tiny Qwen2-VL's <|image_pad|> (365) and <|video_pad|> (366)
FORCED = 366  # what the target is made to write at step FORCED_AT
FORCED_AT = 3
TEXT_DRAFT = dict(model_type="llama", hidden_size=32, num_hidden_layers=2,
                  intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-6,
                  num_key_value_heads=2)


class Seen:
    """The ids a table was fed (kept lazy: a greedy draft chain feeds unevaluated ids)."""

    def __init__(self):
        self.ids: list[mx.array] = []

    def most(self) -> int:
        return max(int(mx.max(ids).item()) for ids in self.ids)


class SpyEmbedding(nn.Embedding):
    def __init__(self, table: nn.Embedding, seen: Seen):
        super().__init__(*table.weight.shape)
        self.weight = table.weight
        self.seen = seen  # a plain object: not one of the module's parameters

    def __call__(self, ids: mx.array) -> mx.array:
        self.seen.ids.append(ids)
        return super().__call__(ids)


def spied(owner: nn.Module) -> Seen:
    """Every id ``owner.embed_tokens`` looks up from now on."""
    seen = Seen()
    owner.embed_tokens = SpyEmbedding(owner.embed_tokens, seen)
    return seen


def text_draft(rows: int, **config):
    """A random mlx-lm Llama over ``rows`` ids, its embedding table spied on."""
    from mlx_lm.models import llama

    draft = llama.Model(llama.ModelArgs(**TEXT_DRAFT, vocab_size=rows, **config))
    mx.eval(draft.parameters())
    return draft, spied(draft.model)


def wide_draft(target_rows: int):
    """A draft whose head is wider than the target's table and proposes, by the sign of
    its first hidden feature, either a common id (7) or one the target lacks."""
    draft, seen = text_draft(target_rows + 8, tie_word_embeddings=False)
    head = mx.zeros(draft.lm_head.weight.shape)
    head[7, 0] = -100.0
    head[target_rows + 3, 0] = 100.0
    draft.lm_head.weight = head
    mx.eval(draft.parameters())
    return draft, seen


class Forcing:
    """A logits processor that makes the model write ``token`` at answer step ``at``."""

    def __init__(self, prompt_length: int, token: int = FORCED, at: int = FORCED_AT):
        self.prompt_length, self.token, self.at = prompt_length, token, at

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        if history.size != self.prompt_length + self.at:
            return logits
        return mx.where(mx.arange(logits.shape[-1]) == self.token, 1e4, logits)

    def processor(self, max_tokens: int):  # as SamplingOptions.extra_processors calls it
        return self


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    """The tiny Qwen2-VL (368 embedding rows) with its table spied on."""
    model, processor = mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))
    return model, processor, spied(model.language_model.model)


def inputs_of(model, processor, text):
    return prepare_inputs(processor, user(None, text), [IMAGE],
                          feature_names=model.feature_names)


def run(model, processor, text=PROMPT, **options):
    results = list(mlxvlm.stream_generate(model, processor, user(None, text), image=[IMAGE],
                                          max_tokens=NEW, **options))
    return [r.token for r in results], results[-1]


def test_the_rows_of_each_table_are_found(target):
    model, _, _ = target
    assert embedding_rows(model) == model.language_model.model.embed_tokens.weight.shape[0] == 368
    assert embedding_rows(text_draft(SMALL_ROWS)[0]) == SMALL_ROWS
    draft, _ = text_draft(SMALL_ROWS)
    nn.quantize(draft, group_size=32, bits=4)
    assert type(draft.model.embed_tokens) is nn.QuantizedEmbedding
    assert embedding_rows(draft) == SMALL_ROWS


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_smaller_draft_stops_before_an_id_it_lacks(target, temperature):
    model, processor, _ = target
    force = Forcing(inputs_of(model, processor, PROMPT).num_tokens)
    options = dict(logits_processors=[force], temperature=temperature, seed=5)
    plain, _ = run(model, processor, **options)
    assert plain[FORCED_AT] == FORCED and max(plain[:FORCED_AT]) < SMALL_ROWS
    draft, seen = text_draft(SMALL_ROWS)
    tokens, last = run(model, processor, draft_model=draft, num_draft_tokens=3, **options)
    assert seen.most() < SMALL_ROWS  # the draft never read past its table
    assert last.speculation.stopped_drafting == 1 and last.speculation.drafted > 0
    if temperature == 0.0:
        assert tokens == plain
    else:
        assert FORCED in tokens and len(tokens) == NEW


def test_a_vision_language_draft_lacking_a_prompt_id_never_drafts(target, tiny_checkpoints):
    """A Qwen2-VL draft whose table stops below the prompt's <|image_pad|> is never fed
    the prompt (its prefill would look the placeholders up too)."""
    model, processor, _ = target
    draft = mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))[0]
    text = draft.language_model.model
    table = nn.Embedding(SMALL_ROWS, text.embed_tokens.weight.shape[1])
    table.weight = text.embed_tokens.weight[:SMALL_ROWS]
    text.embed_tokens = table
    seen = spied(text)
    plain, _ = run(model, processor)
    tokens, last = run(model, processor, draft_model=draft)
    assert tokens == plain
    assert last.speculation.drafted == 0 and last.speculation.stopped_drafting == 1
    assert not seen.ids


def test_a_wider_draft_is_cut_before_the_verify_pass(target):
    model, processor, target_seen = target
    rows = embedding_rows(model)
    plain, _ = run(model, processor)
    draft, draft_seen = wide_draft(rows)
    target_seen.ids.clear()
    tokens, last = run(model, processor, draft_model=draft, num_draft_tokens=4)
    assert tokens == plain
    assert draft_seen.most() >= rows  # it did propose ids the target lacks ...
    assert target_seen.most() < rows  # ... which never reached the target
    assert last.speculation.drafted > 0 and last.speculation.stopped_drafting == 0


@pytest.mark.parametrize("kind", ["smaller", "wider"])
def test_the_draft_batch_keeps_each_row_inside_both_tables(target, kind):
    """Three requests speculating in one batch (the draft drafting for all rows at once);
    one of them is made to write an id the smaller draft lacks."""
    model, processor, target_seen = target
    rows = embedding_rows(model)
    texts = [PROMPT, "Hi", "What colours are in it?"]
    forcing = Forcing(inputs_of(model, processor, texts[1]).num_tokens)
    extra = [(), (forcing,), ()]
    alone = [run(model, processor, text, logits_processors=list(processors))[0]
             for text, processors in zip(texts, extra)]
    assert alone[1][FORCED_AT] == FORCED
    draft, draft_seen = text_draft(SMALL_ROWS) if kind == "smaller" else wide_draft(rows)
    engine = BatchEngine(model, processor, max_batch_size=4, prefill_step_size=256,
                         speculation=Speculation(draft_model=draft, num_draft_tokens=3))
    engine.speculation_rule = SpeculationRule(adaptive=False)
    target_seen.ids.clear()
    received = []
    for text, processors in zip(texts, extra):
        got: list = []
        engine.submit(inputs_of(model, processor, text),
                      SamplingOptions(max_tokens=NEW, extra_processors=processors), got.append)
        received.append(got)
    run_to_end(engine)
    assert [[s.token for s in got if isinstance(s, BatchStep)] for got in received] == alone
    assert target_seen.most() < rows and engine.stats.drafted_tokens > 0
    if kind == "smaller":
        assert draft_seen.most() < SMALL_ROWS
        assert engine.stats.stopped_drafts == 1
    else:
        assert draft_seen.most() >= rows and engine.stats.stopped_drafts == 0


@pytest.fixture(scope="module")
def small_draft_checkpoint(target, tmp_path_factory):
    """The smaller draft as an mlx-lm checkpoint with the target's tokenizer (its table
    padded differently: the tokenizer's 367 ids against 365 rows)."""
    from mlx_lm.utils import save_config, save_model

    path = tmp_path_factory.mktemp("small-draft")
    save_model(path, text_draft(SMALL_ROWS)[0])
    save_config({**TEXT_DRAFT, "vocab_size": SMALL_ROWS}, path / "config.json")
    target[1].tokenizer.save_pretrained(path)
    return path


def test_a_draft_with_another_tokenizer_is_refused_at_load(target, tiny_checkpoints,
                                                           small_draft_checkpoint, capsys):
    from mlxvlm.generate.__main__ import main as run_generate_cli
    from mlxvlm.generate.drafters import load_draft

    model, processor, _ = target
    load_draft(str(small_draft_checkpoint), processor)  # padding differs: accepted
    other = str(tiny_checkpoints.path("idefics3", "hub"))
    with pytest.raises(MlxvlmError, match="tokenizer differs from the model's"):
        load_draft(other, processor)
    with pytest.raises(MlxvlmError, match="tokenizer differs from the model's"):
        mlxvlm.generate(model, processor, PROMPT, IMAGE, max_tokens=2, draft_model=other)
    path = str(tiny_checkpoints.path("qwen2_vl", "hub"))
    assert run_generate_cli(["--model", path, "--prompt", PROMPT, "--max-tokens", "2",
                             "--draft-model", other]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the draft model's tokenizer differs from the model's")
    served = subprocess.run([sys.executable, "-m", "mlxvlm.server", "--model", path,
                             "--draft-model", other, "--port", "0"],
                            capture_output=True, text=True, timeout=300,
                            env=user_environment())  # a user's process: torch-free
    assert served.returncode == 2, served.stderr
    assert served.stderr.strip().splitlines()[-1].startswith(
        "error: the draft model's tokenizer differs from the model's")


def test_the_server_stops_drafting_at_an_id_the_draft_lacks(tiny_checkpoints,
                                                            small_draft_checkpoint):
    """``python -m mlxvlm.server --draft-model``: a request whose answer holds an id the
    draft lacks (logit_bias) drafts nothing from there; another drafts as before."""
    import httpx
    from server_process import ServerProcess

    path = str(tiny_checkpoints.path("qwen2_vl", "hub"))

    def ask(server, **extra):
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 12, "temperature": 0.0, **extra}
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def drafted(server):
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        return next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("mlxvlm_draft_tokens_total"))

    with ServerProcess("--model", path, "--served-model-name", "m",
                       "--draft-model", str(small_draft_checkpoint)) as server:
        ask(server)
        before = drafted(server)
        forced = ask(server, logit_bias={str(FORCED): 100})
        after = drafted(server)
    assert before > 0
    assert after == before  # its first token is one the draft lacks: nothing drafted
    assert forced["usage"]["completion_tokens"] == 12


def test_a_draft_id_the_target_has_no_logit_for_is_never_accepted():
    """A target whose head is narrower than its table (Mllama's 8 image rows) lets such
    ids through the cut; the speculative-sampling rule rejects them."""
    import numpy as np

    from mlxvlm.generate.acceptance import accept_sampled
    from mlxvlm.generate.speculative import fit_draft

    p = np.full((2, 4), 0.25)
    q = np.eye(1, 6, 5)  # the draft drew id 5 with certainty; the target has 4 logits
    accepted, token = accept_sampled(p, [5], fit_draft(q, 4), np.random.default_rng(0))
    assert accepted == 0 and 0 <= token < 4
