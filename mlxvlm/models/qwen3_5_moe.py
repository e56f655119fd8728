"""Qwen3.5-MoE: Qwen3.5 whose every decoder MLP is a sparse mixture of experts plus a
shared expert (mlx-lm's ``Qwen3NextSparseMoeBlock``: a softmax router picking
``num_experts_per_tok`` experts, their weights renormalized, and a shared expert scaled
by a sigmoid gate). Everything else is Qwen3.5's.

Hugging Face checkpoints store each layer's experts as two 3-D tensors,
``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``; ``sanitize`` splits them into
mlx-lm's ``switch_mlp.gate_proj`` / ``up_proj`` / ``down_proj`` (experts, out, in), the
names mlx-community publishes. Their orientation is read from their shape: (experts,
out, in) as transformers 5 writes them, or (experts, in, out).
"""

from __future__ import annotations

import mlx.core as mx

from mlxvlm.models import qwen3_5
from mlxvlm.models.qwen3_vl_moe import RequiresExperts, split_experts


class Model(RequiresExperts, qwen3_5.Model):
    def _experts_out_in(self, weights: dict[str, mx.array]) -> bool:
        text = self.args.text
        for name, value in weights.items():
            if name.endswith(".mlp.experts.gate_up_proj"):
                out_in = value.shape[1] == 2 * text.moe_intermediate_size
                in_out = value.shape[2] == 2 * text.moe_intermediate_size
                if out_in != in_out:
                    return out_in
        return self._writer_out_in  # square experts: the writer's version decides

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        split = split_experts(weights, self.args.text, self._experts_out_in(weights))
        return super().sanitize(split)


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
