"""The chat's API takes a message as plain text too.

The message box is a ``MultimodalTextbox``, whose value is ``{"text": ..., "files": [...]}``;
a client that sends only text (``client.predict("Hello", api_name="/chat")``, as for a
text chat) would get Gradio's validation error. Such a string is the text of a message
without files, turned into that shape before Gradio validates it.
"""

from __future__ import annotations

import gradio as gr
from gradio.blocks import Blocks


def accept_text_messages(app: Blocks) -> None:
    """Every event of ``app`` that reads a ``MultimodalTextbox`` also takes a string."""
    preprocess_data = app.preprocess_data

    async def with_text_messages(block_fn, inputs, state, *args, **kwargs):
        if inputs is not None:
            inputs = list(inputs)
            for index, block in enumerate(block_fn.inputs):  # aligned, as Gradio reads them
                if isinstance(block, gr.MultimodalTextbox) and isinstance(inputs[index], str):
                    inputs[index] = {"text": inputs[index], "files": []}
        return await preprocess_data(block_fn, inputs, state, *args, **kwargs)

    app.preprocess_data = with_text_messages
