"""A speaking checkpoint's voices, named as it spells them, matched case-insensitively
(as transformers matches Qwen3-Omni's speaker ids)."""

from __future__ import annotations

from mlxvlm.errors import MlxvlmError

# transformers' default speaker for Qwen3-Omni (Qwen2.5-Omni's, Chelsie, is in
# speech/stages.py)
DEFAULT_VOICE = "Ethan"


def voice_names(speakers: dict[str, int]) -> list[str]:
    """The voices for users: each name capitalized as the model cards write them."""
    return sorted(name[:1].upper() + name[1:] for name in speakers)


def resolve_voice(speakers: dict[str, int], voice: str | None) -> tuple[str, int]:
    """(the voice's name, its speaker id); ``voice`` None: transformers' default where
    the checkpoint has it, else its first voice. An unknown voice is a one-line error
    naming the voices."""
    if not speakers:
        raise MlxvlmError("this model names no voices (its talker config has no speaker_id)")
    by_lower = {name.lower(): (name, sid) for name, sid in speakers.items()}
    if voice is None:
        name, sid = by_lower.get(DEFAULT_VOICE.lower()) or by_lower[sorted(by_lower)[0]]
    else:
        found = by_lower.get(voice.strip().lower())
        if found is None:
            raise MlxvlmError(f"unknown voice {voice!r}: this model's voices are "
                              f"{', '.join(voice_names(speakers))}")
        name, sid = found
    return name[:1].upper() + name[1:], sid
