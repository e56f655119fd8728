"""Qwen3-VL-MoE: Qwen3-VL whose decoder MLPs are sparse mixtures of experts (mlx-lm's
``Qwen3MoeSparseMoeBlock``: a softmax router picking ``num_experts_per_tok`` experts,
their weights renormalized). Everything else is Qwen3-VL's.

Hugging Face checkpoints store each layer's experts as two 3-D tensors,
``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``, in one of two orientations:
the Hub's original checkpoints (written by transformers 4.57) as (experts, in, out),
transformers 5's ``save_pretrained`` as (experts, out, in). The writer's version in
config.json says which. ``sanitize`` splits them into mlx-lm's ``switch_mlp.gate_proj``
/ ``up_proj`` / ``down_proj`` (experts, out, in), the names mlx-community publishes.
"""

from __future__ import annotations

import mlx.core as mx

from mlxvlm.models import qwen3_vl


def experts_stored_out_in(config: dict) -> bool:
    """Whether the checkpoint's expert tensors are (experts, out, in): written by
    transformers 5 (the Hub's originals, from 4.57, are (experts, in, out))."""
    version = str(config.get("transformers_version") or "4")
    return int(version.split(".")[0]) >= 5


class RequiresExperts:
    """Mixed in before a MoE family's dense parent: ``from_config`` refuses a config
    without experts and notes how the writer stores them."""

    @classmethod
    def from_config(cls, config: dict):
        model = super().from_config(config)
        if model.args.text.num_experts == 0:
            raise ValueError(f"a {config.get('model_type')} config must set num_experts "
                             "(or num_local_experts)")
        model._writer_out_in = experts_stored_out_in(config)
        return model


class Model(RequiresExperts, qwen3_vl.Model):
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize(split_experts(weights, self.args.text, self._writer_out_in))


def split_experts(weights: dict[str, mx.array], text, out_in: bool) -> dict[str, mx.array]:
    """Hugging Face's 3-D ``mlp.experts.gate_up_proj`` / ``down_proj`` as mlx-lm's
    ``mlp.switch_mlp.{gate,up,down}_proj`` (experts, out, in); ``out_in``: whether they are
    stored so already. ``text`` names ``num_experts``, ``moe_intermediate_size`` and
    ``hidden_size`` (Qwen3-VL-MoE's and Qwen3.5-MoE's configs)."""
    split = {}
    for name, value in weights.items():
        prefix, _, kind = name.rpartition(".mlp.experts.")
        if not prefix:
            split[name] = value
            continue
        if not out_in:
            value = value.transpose(0, 2, 1)
        target = f"{prefix}.mlp.switch_mlp"
        if kind == "gate_up_proj":
            width = text.moe_intermediate_size
            expected = (text.num_experts, 2 * width, text.hidden_size)
            _check_shape(name, value, expected)
            split[f"{target}.gate_proj.weight"] = value[:, :width]
            split[f"{target}.up_proj.weight"] = value[:, width:]
        elif kind == "down_proj":
            expected = (text.num_experts, text.hidden_size, text.moe_intermediate_size)
            _check_shape(name, value, expected)
            split[f"{target}.down_proj.weight"] = value
        else:
            raise ValueError(f"unexpected expert tensor {name!r}")
    return split


def stack_expert_modules(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """One tensor per expert (``mlp.experts.E.gate_proj.weight``, (out, in), as the Hub's
    Qwen3-MoE checkpoints store them) stacked in expert order as mlx-lm's
    ``mlp.switch_mlp.gate_proj.weight`` (experts, out, in)."""
    stacked: dict[str, mx.array] = {}
    experts: dict[str, dict[int, mx.array]] = {}
    for name, value in weights.items():
        prefix, _, rest = name.rpartition(".mlp.experts.")
        index, _, leaf = rest.partition(".")
        if not prefix or not index.isdigit():
            stacked[name] = value
            continue
        experts.setdefault(f"{prefix}.mlp.switch_mlp.{leaf}", {})[int(index)] = value
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"the experts of {name!r} are not numbered 0..{len(by_index) - 1}")
        stacked[name] = mx.stack([by_index[i] for i in range(len(by_index))])
    return stacked


def _check_shape(name: str, value: mx.array, expected: tuple[int, ...]) -> None:
    if tuple(value.shape) != expected:
        raise ValueError(
            f"{name} has shape {tuple(value.shape)} but the config implies {expected} "
            "(experts, out, in); the checkpoint's transformers_version does not match how "
            "its expert tensors are laid out"
        )


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
