"""Where drafted tokens come from: n-grams of the sequence itself (prompt lookup) or a
smaller draft model sharing the target's tokenizer.

A drafter answers ``propose(context, k)`` with up to ``k`` tokens (and, for a draft model
that samples, the distribution each was drawn from) and hears ``update(accepted,
next_token)`` once the target has judged them. ``context`` is the target's view: the
prompt's token ids and every token emitted so far.

A draft model sees the prompt its own way:

- a vision-language draft (an mlxvlm family, e.g. a quantized copy of the target) gets
  the prompt prepared by its own processor, media included (the target's inputs where it
  comes without a processor: the two then share one);
- a text-only draft (an mlx-lm model) gets the target's prompt ids with every media
  placeholder token (image, video and audio positions) removed: the text around the media,
  the chat template's markers included, and then the answer so far.

A draft model's ids are kept inside both embedding tables (``draft_vocab``): it stops
drafting once its sequence holds an id its own table lacks, and its drafts are cut at
the first id the target's table lacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.generate.acceptance import is_greedy, sampling_distribution
from mlxvlm.generate.draft_vocab import check_same_tokenizer, embedding_rows, in_table
from mlxvlm.generate.loop import generation_stream, prefill_prompt
from mlxvlm.generate.mtp_drafter import MtpDrafter
from mlxvlm.generate.rewind import CacheCheckpoint
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.prompt import PreparedInputs
from mlxvlm.sampling import SamplingOptions, step_seed

# Longest n-gram prompt lookup matches (transformers' max_matching_ngram_size is 2; a
# third token makes a match in a document much likelier to continue as before).
LOOKUP_MAX_NGRAM = 3


class PromptLookupDrafter:
    """Drafts by prompt lookup (transformers' ``prompt_lookup_num_tokens``): the tokens
    that followed the latest earlier occurrence of the sequence's last n tokens (n from
    ``max_ngram`` down to 1) that ``k`` tokens follow, in the prompt or the answer so far. Costs no model pass;
    suits answers that copy the prompt (documents, OCR, code edits)."""

    def __init__(self, max_ngram: int = LOOKUP_MAX_NGRAM):
        self.max_ngram = max_ngram

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], None]:
        ids = np.asarray(context, dtype=np.int64)
        total = len(ids)
        for n in range(min(self.max_ngram, total - 1), 0, -1):
            tail = ids[total - n:]
            # Windows ending before the tail itself, latest first, with a token after them.
            windows = np.lib.stride_tricks.sliding_window_view(ids[: total - 1], n)
            matches = np.flatnonzero((windows == tail).all(axis=1))
            if matches.size:
                # The latest match that is followed by k tokens (a match overlapping the
                # tail, as in a repeated token, has fewer), else the earliest.
                full = matches[matches + n + k <= total]
                start = int(full[-1] if full.size else matches[0]) + n
                return ids[start : start + k].tolist(), None
        return [], None

    def update(self, accepted: int, next_token: int) -> None:
        pass


class DraftModelDrafter:
    """Drafts with a smaller model: ``k`` one-token steps of its own cache, sampled as
    the target samples (greedy for greedy). Its cache keeps only accepted tokens: after
    the target's verdict the rejected drafts are trimmed, or (a recurrent or wrapped
    rotating cache) the cache goes back to where the round's drafting began and the
    accepted tokens are fed with the next round's first step.

    ``target_rows``: the target's embedding rows; drafts stop before an id past them.
    Once the sequence holds an id past the draft's own table (``stopped``) the drafter
    drafts nothing more and lets its cache go."""

    def __init__(self, model: nn.Module, inputs: PreparedInputs | list[int], options: SamplingOptions,
                 *, target_rows: int, prefill_step_size: int = 2048, seed: int | None = None):
        self.model = model
        self.options = options
        self.greedy = is_greedy(options)
        self.rng = np.random.default_rng(seed)
        self.is_vlm = isinstance(inputs, PreparedInputs)
        self.rows = embedding_rows(model)
        self.target_rows = target_rows
        self.stopped = False
        self.state = None
        self.pending: list[int] = []  # accepted tokens the draft has not been fed yet
        self.drafts: list[int] = []
        self.fed = 0  # of the drafts, those fed to the draft's cache (the last one never is)
        self.checkpoint: CacheCheckpoint | None = None
        self.cache = None
        if not self._holds(self._prompt_ids(inputs)):
            self.stopped = True
        elif self.is_vlm:
            self.cache = model.make_cache()
            self._prefill_vlm(inputs, prefill_step_size)
        else:
            from mlx_lm.models.cache import make_prompt_cache

            self.cache = make_prompt_cache(model)
            self._prefill_text(mx.array([inputs]), prefill_step_size)

    def _prompt_ids(self, inputs: PreparedInputs | list[int]) -> list[int]:
        """The prompt's ids the draft is fed (a vision-language draft's media
        placeholders included: its ``embed`` looks them up too)."""
        return inputs.input_ids[0].tolist() if self.is_vlm else inputs

    def _holds(self, ids: Sequence[int]) -> bool:
        return in_table(ids, self.rows) == len(ids)

    def stop(self) -> None:
        """The sequence holds an id the draft's table lacks: no more drafting."""
        self.stopped = True
        self.cache = self.checkpoint = None
        self.pending, self.drafts = [], []

    def take(self, pending: list[int]) -> None:
        """The accepted tokens the draft is to be fed next (or the end of drafting)."""
        self.pending = pending
        if not self._holds(pending):
            self.stop()

    def fitted(self, logits: mx.array) -> mx.array:
        """``logits`` over the ids the draft's table holds: a head wider than the table
        would feed the draft's own chain an id it lacks."""
        return logits[..., : self.rows] if logits.shape[-1] > self.rows else logits

    def within_target(self, drafts: list[int], q: np.ndarray | None
                      ) -> tuple[list[int], np.ndarray | None]:
        """``drafts`` (and their distributions) up to the first id the target lacks."""
        kept = in_table(drafts, self.target_rows)
        return drafts[:kept], (None if q is None else q[:kept])

    def _prefill_vlm(self, inputs: PreparedInputs, step: int) -> None:
        ids = inputs.input_ids
        embeddings, self.state, done = prefill_prompt(self.model, inputs, self.cache, step,
                                                      lambda _: None, lambda *_: None)
        with mx.stream(generation_stream):
            self.model(ids[:, done:], self.cache, embeddings=embeddings[:, done:],
                       state=self.state, last_only=True)
            mx.eval([c.state for c in self.cache])

    def _prefill_text(self, ids: mx.array, step: int) -> None:
        with mx.stream(generation_stream):
            for start in range(0, ids.shape[1], step):
                self.model(ids[:, start : start + step], cache=self.cache)
                mx.eval([c.state for c in self.cache])

    def _last_logits(self, ids: mx.array) -> mx.array:
        with mx.stream(generation_stream):
            if self.is_vlm:
                logits = self.model(ids, self.cache, state=self.state, last_only=True)
            else:
                logits = self.model(ids, cache=self.cache)
            return self.fitted(logits[:, -1, :]).astype(mx.float32)

    def _draw(self, logits: mx.array) -> tuple[int, np.ndarray]:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        q = sampling_distribution(logprobs, self.options)[0]
        return int(self.rng.choice(q.shape[-1], p=q)), q

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], np.ndarray | None]:
        self.drafts, self.checkpoint, self.fed = [], None, 0
        if k == 0 or self.stopped:
            return [], None
        logits = self._last_logits(mx.array([self.pending]))
        self.pending = []
        # The checkpoint follows the accepted tokens' step: only drafts come after it.
        self.checkpoint = CacheCheckpoint(self.cache)
        if self.greedy:
            # The whole chain as one graph, read once: each argmax feeds the next step
            # without a round trip to Python.
            tokens = [mx.argmax(logits, axis=-1)]
            for _ in range(k - 1):
                tokens.append(mx.argmax(self._last_logits(tokens[-1][None]), axis=-1))
            drafts = mx.concatenate(tokens).tolist()
            self.fed = len(drafts) - 1
            self.drafts = self.within_target(drafts, None)[0]
            return self.drafts, None
        token, q = self._draw(logits)
        drafts, dists = [token], [q]
        for _ in range(k - 1):
            token, q = self._draw(self._last_logits(mx.array([[token]])))
            drafts.append(token)
            dists.append(q)
        self.fed = len(drafts) - 1
        self.drafts, q = self.within_target(drafts, np.stack(dists))
        return self.drafts, q

    def update(self, accepted: int, next_token: int) -> None:
        if self.stopped:
            return
        if self.checkpoint is None:  # nothing drafted: the token waits for the next step
            self.take([*self.pending, next_token])
            return
        if accepted > self.fed:  # all fed drafts kept, and the one drawn after them
            self.take([self.drafts[-1], next_token])
        elif self.checkpoint.rewind(self.cache, accepted):
            self.take([next_token])
        else:
            self.take([*self.drafts[:accepted], next_token])
        self.checkpoint = None


def text_prompt(input_ids: mx.array, placeholder_ids: set[int]) -> list[int]:
    """A text-only draft's prompt: the target's ids without media placeholders."""
    return [t for t in input_ids[0].tolist() if t not in placeholder_ids]


def load_draft(path: str, target_processor: Any = None) -> tuple[nn.Module, Any]:
    """``(model, processor)`` of a draft checkpoint: an mlxvlm family's through ``load``,
    else a text model through mlx-lm's (processor None). With ``target_processor``, a
    draft whose tokenizer differs from the target's is refused."""
    from mlxvlm.checkpoint.loading import load
    from mlxvlm.models import UnsupportedModelError

    try:
        model, processor = load(path)
        tokenizer = processor
    except UnsupportedModelError:
        from mlx_lm import load as load_text_model

        model, tokenizer = load_text_model(str(path))[:2]
        processor = None
    if target_processor is not None:
        check_same_tokenizer(target_processor, tokenizer)
    return model, processor


def make_drafter(
    target: nn.Module,
    inputs: PreparedInputs,
    options: SamplingOptions,
    *,
    draft_model: Any = None,
    prompt_lookup: bool = False,
    mtp: bool = False,
    prepare_draft_inputs: Callable[[Any, nn.Module], PreparedInputs],
    prefill_step_size: int = 2048,
    target_processor: Any = None,
):
    """The drafter for a run: prompt lookup, the target's own MTP head (``mtp``; it must
    watch the target's passes from the prompt's first: ``mtp_drafter``), or
    ``draft_model`` (a model, a ``(model, processor)`` pair as ``load`` returns, or a
    checkpoint path), whose prompt is made as the module's docstring says
    (``prepare_draft_inputs(processor, model)``: the same prompt and media through the
    draft's processor). ``target_processor``, if given, is checked to share its tokenizer
    with a draft that comes with one."""
    if prompt_lookup:
        return PromptLookupDrafter()
    seed = None if options.seed is None else step_seed(options.seed, -1)
    if mtp:
        return MtpDrafter(target, options, chunk=prefill_step_size, seed=seed)
    if isinstance(draft_model, (str, Path)):
        model, processor = load_draft(str(draft_model), target_processor)
    elif isinstance(draft_model, tuple):
        model, processor = draft_model
        if target_processor is not None and processor is not None:
            check_same_tokenizer(target_processor, processor)
    else:
        model, processor = draft_model, None
    if isinstance(model, VisionLanguageModel):
        draft_inputs = inputs if processor is None else prepare_draft_inputs(processor, model)
    else:
        draft_inputs = text_prompt(inputs.input_ids, set(target.placeholder_token_ids))
    return DraftModelDrafter(model, draft_inputs, options, target_rows=embedding_rows(target),
                             prefill_step_size=prefill_step_size, seed=seed)
