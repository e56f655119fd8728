"""The reference side of the video parity tests: transformers' own processor for a
checkpoint, with torchvision's video processor, through ``apply_chat_template``."""

from __future__ import annotations


def transformers_inputs(checkpoint, messages, fps=None, **options):
    """transformers' processor for ``checkpoint`` through ``apply_chat_template(tokenize=
    True)`` on ``messages`` naming video files: each video decoded by transformers'
    ``load_video`` (PyAV: torchcodec, its default decoder, is not installed) and sampled
    by the video processor itself from the metadata, at ``fps`` if given (else as the
    processor does by default). Images go through the PIL image processor, as mlxvlm's
    do (each family's image parity tests hold it to transformers')."""
    from transformers import AutoImageProcessor, AutoProcessor
    from transformers.video_utils import load_video

    processor = AutoProcessor.from_pretrained(
        checkpoint, image_processor=AutoImageProcessor.from_pretrained(checkpoint, backend="pil"))
    decoded, metadata = [], []
    for message in messages:
        content = []
        for part in message["content"]:
            if part["type"] == "video":
                frames, meta = load_video(part["video"], backend="pyav")
                part = {"type": "video", "video": frames}
                metadata.append(meta)
            content.append(part)
        decoded.append({**message, "content": content})
    options = {"video_metadata": metadata, **options}
    if fps is not None:
        options["fps"] = fps
    return processor.apply_chat_template(
        decoded, tokenize=True, return_dict=True, add_generation_prompt=True,
        return_tensors="pt", processor_kwargs=options)
