"""An answer the thinker is made to write: its tokens forced one by one (every other
token's logit -inf), so that the talker speaks given text with the thinker's own states
for it -- how text is turned into speech by a model that speaks only its answers (the
input as the assistant's turn, as vLLM-Omni proposes for Qwen3-Omni's TTS)."""

from __future__ import annotations

from typing import Any, Callable, Collection, Sequence

import mlx.core as mx

from mlxvlm.errors import MlxvlmError
from mlxvlm.text.tokenization import tokenizer_of

# The end of an assistant turn in the Qwen chat templates the omni models use.
TURN_END = "<|im_end|>"


class ForcedAnswer:
    """A ``SamplingOptions.extra_processors`` entry: the answer is ``ids``."""

    def __init__(self, ids: Sequence[int]):
        if not ids:
            raise MlxvlmError("there is no text to say")
        self.ids = list(ids)

    @classmethod
    def of_text(cls, processor: Any, text: str, eos_ids: Collection[int]) -> "ForcedAnswer":
        """``text``'s tokens, then the end of the turn (else the first of ``eos_ids``)."""
        tokenizer = tokenizer_of(processor)
        end = tokenizer.convert_tokens_to_ids(TURN_END)
        if not isinstance(end, int) or end == tokenizer.unk_token_id:
            end = sorted(eos_ids)[0]
        return cls(list(tokenizer.encode(text, add_special_tokens=False)) + [end])

    def processor(self, max_tokens: int) -> Callable[[mx.array, mx.array], mx.array]:
        steps = iter(self.ids)

        def force(_tokens: mx.array, logits: mx.array) -> mx.array:
            token = next(steps, self.ids[-1])
            chosen = mx.arange(logits.shape[-1]) == token
            return mx.where(chosen, mx.zeros_like(logits), mx.full(logits.shape, -mx.inf, logits.dtype))

        return force
