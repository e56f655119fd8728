"""The Gradio page: a multimodal chat with the sampling controls and the model's figures
at its side."""

from __future__ import annotations

import gradio as gr
from gradio.utils import get_upload_folder

from mlxvlm.ui.session import ChatSession

# The slider's top when the model does not say how long its context is.
MAX_TOKENS_CAP = 8192


def upload_media_options() -> dict:
    """Limits for reading attachments: only files that Gradio received as uploads."""
    return {"allow_remote": False, "allowed_dir": get_upload_folder()}


def build_app(session: ChatSession) -> gr.Blocks:
    """The page for ``session``; launch it with ``.queue().launch(...)``."""
    kinds = [kind.name for kind in session.kinds]
    attach = f"attach {' / '.join(kinds)}" if kinds else "this model reads text only"
    max_tokens_cap = min(session.max_context or MAX_TOKENS_CAP, MAX_TOKENS_CAP)

    with gr.Blocks(title=f"mlxvlm · {session.model_name}", analytics_enabled=False) as app:
        with gr.Row(equal_height=False):
            # The chat sits first (left) but is built last: ChatInterface must find its
            # controls already rendered, or it puts them in an accordion under the chat.
            chat_column = gr.Column(scale=3)
            with gr.Column(scale=1, min_width=280):
                gr.Markdown(
                    f"**Model** `{session.model_name}`  \n"
                    f"family `{session.model_type}` · context "
                    f"{session.max_context or 'unknown'} tokens",
                    elem_id="model-panel",
                )
                stats = gr.Markdown(session.stats_markdown(), elem_id="answer-stats")
                system = gr.Textbox(
                    label="System prompt", lines=3, placeholder="(the model's default)"
                )
                temperature = gr.Slider(
                    0.0, 2.0, value=0.0, step=0.05, label="Temperature (0: greedy)"
                )
                top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p")
                max_tokens = gr.Slider(
                    1, max_tokens_cap, value=min(256, max_tokens_cap), step=1,
                    label="Max new tokens", elem_id="max-tokens",
                )
                repetition_penalty = gr.Slider(
                    1.0, 2.0, value=1.0, step=0.05, label="Repetition penalty (1: off)"
                )
                seed = gr.Number(value=-1, precision=0, label="Seed (-1: random)")

        with chat_column:
            gr.ChatInterface(
                session.respond,
                multimodal=True,
                chatbot=gr.Chatbot(label="Chat", height=560, elem_id="chat"),
                textbox=gr.MultimodalTextbox(
                    file_types=kinds or None,
                    file_count="multiple",
                    sources=["upload"] if kinds else [],
                    placeholder=f"Ask a question ({attach})",
                    stop_btn=True,  # a given textbox brings its own buttons
                    elem_id="message",
                ),
                additional_inputs=[
                    system, temperature, top_p, max_tokens, repetition_penalty, seed
                ],
                additional_outputs=[stats],
                api_name="chat",
                fill_height=True,
                analytics_enabled=False,
            )
    return app
