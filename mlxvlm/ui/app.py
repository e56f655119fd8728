"""The Gradio page: a multimodal chat with the sampling controls and the model's figures
at its side."""

from __future__ import annotations

import gradio as gr

from mlxvlm.media import MediaPolicy
from mlxvlm.sampling_defaults import checkpoint_defaults, resolve
from mlxvlm.ui.fields import guard_file_handling
from mlxvlm.ui.session import ChatSession
from mlxvlm.ui.uploads import process_uploads, watch_upload_route

# The slider's top when the model does not say how long its context is.
MAX_TOKENS_CAP = 8192


def upload_media_options() -> MediaPolicy:
    """Limits for reading attachments: only files in this process's upload folder (the
    chat accepts only uploads, see ``uploads``; this is the media reader's own check)."""
    return MediaPolicy(allow_remote=False, allowed_dir=str(process_uploads().directory))


def build_app(session: ChatSession) -> gr.Blocks:
    """The page for ``session``; launch it with ``.queue().launch(...)``. The session
    then answers only with files uploaded through the page, each in its own conversation."""
    # Before any component: Gradio reads its upload folder when a component is made.
    uploads = process_uploads()
    session.uploads = uploads
    kinds = [kind.name for kind in session.kinds]
    attach = f"attach {' / '.join(kinds)}" if kinds else "this model reads text only"
    max_tokens_cap = min(session.max_context or MAX_TOKENS_CAP, MAX_TOKENS_CAP)

    # The controls start where the checkpoint's generation_config.json puts them (greedy
    # where it sets nothing), as the CLI and the server do for values left out.
    initial = resolve({}, checkpoint_defaults(session.processor)).values

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
                    0.0, 2.0, value=initial["temperature"], step=0.05,
                    label="Temperature (0: greedy)",
                )
                top_p = gr.Slider(0.05, 1.0, value=max(0.05, initial["top_p"]), step=0.05,
                                  label="Top-p")
                max_tokens = gr.Slider(
                    1, max_tokens_cap, value=min(256, max_tokens_cap), step=1,
                    label="Max new tokens", elem_id="max-tokens",
                )
                repetition_penalty = gr.Slider(
                    1.0, 2.0, value=min(2.0, max(1.0, initial["repetition_penalty"] or 1.0)),
                    step=0.05, label="Repetition penalty (1: off)",
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
    guard_file_handling(app, uploads)
    watch_upload_route(app, uploads)
    return app
