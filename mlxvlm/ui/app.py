"""The Gradio page: a multimodal chat with the model picker, the sampling controls and
the model's figures at its side."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import gradio as gr

from mlxvlm.media import NO_NAMES, MediaPolicy
from mlxvlm.model_pool import PoolError
from mlxvlm.sampling.defaults import resolve
from mlxvlm.text.tokenization import processor_state
from mlxvlm.ui.api_inputs import accept_text_messages
from mlxvlm.ui.fields import guard_file_handling
from mlxvlm.ui.models import ModelRegistry
from mlxvlm.ui.session import YIELD_EVERY_S, ChatSession, notice
from mlxvlm.ui.spoken_answers import TALKER_TEMPERATURE
from mlxvlm.ui.stats import stale_markdown
from mlxvlm.ui.uploads import process_uploads, watch_upload_route

# The slider's top when the model does not say how long its context is.
MAX_TOKENS_CAP = 8192
PAGE_HEADING = "mlxvlm chat"
# How the empty chat's hint names one attachment of each kind.
ONE_OF_KIND = {"image": "an image", "pdf": "a PDF", "video": "a video", "audio": "a sound"}
# Turns answered (or waiting for their model, then for their turn on it) at once, per
# way in (the page, the API); more wait in Gradio's queue (whose default is one at a
# time). Above one, so that the model pool sees every conversation waiting and serves a
# loaded model's before switching, and so that a conversation prepares its turn while
# another's runs: one conversation's video does not hold up another's text chat.
CONVERSATIONS_AT_ONCE = 16


def upload_media_options() -> MediaPolicy:
    """Limits for reading attachments: only files in this process's upload folder (the
    chat accepts only uploads, see ``uploads``; this is the media reader's own check),
    and the bounds on decoding a server's strangers' media; the page has no options to
    name in errors."""
    return MediaPolicy.served(allow_remote=False, allowed_dir=str(process_uploads().directory),
                              names=NO_NAMES)


def model_labels(names: list[str]) -> list[tuple[str, str]]:
    """The picker's (label, name) pairs: a local checkpoint by its folder's name (unless
    two share one), a Hub model by its repo id."""
    short = [Path(n).name if Path(n).is_dir() else n for n in names]
    return [(s if short.count(s) == 1 else n, n) for s, n in zip(short, names)]


def waiting_markdown(name: str) -> str:
    """The side panel while a turn or a choice waits for its model to be loaded."""
    return f"Waiting for `{name}` to be loaded…"


def model_markdown(session: ChatSession) -> str:
    """Under the picker (whose label is the heading): what the chosen model is."""
    return (f"`{session.model_name}`  \nfamily `{session.model_type}` · context "
            f"{session.max_context or 'unknown'} tokens")


def chat_hint(session: ChatSession) -> str:
    """What the empty chat says to do, for what the model takes."""
    kinds = [ONE_OF_KIND.get(kind.name, kind.name) for kind in session.kinds]
    if not kinds:
        return "**Ask anything.** This model reads text only: type below and press Enter."
    listed = kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"
    return (f"**Ask about {listed}.** Attach files with the message box's upload button "
            "(or drop them on the box), type a question and press Enter.")


def attachment_box(session: ChatSession) -> dict[str, Any]:
    """The message box's attachment settings for the model: the kinds it takes, and the
    microphone where it hears (a recording is uploaded as a WAV file like any upload)."""
    kinds = [kind.name for kind in session.kinds]
    attach = f"attach {' / '.join(kinds)}" if kinds else "this model reads text only"
    sources = (["upload"] + (["microphone"] if "audio" in kinds else [])) if kinds else []
    return dict(file_types=[kind.file_type for kind in session.kinds] or None, sources=sources,
                placeholder=f"Ask a question ({attach})")


def speech_controls(session: ChatSession) -> dict[str, dict[str, Any]]:
    """The speech controls' settings for the model: shown only where it speaks, the
    voice picker with its voices and the API's default voice first."""
    shown = session.speaks
    return {
        "voice": dict(choices=session.voices, value=session.default_voice, visible=shown),
        "speak": dict(visible=shown),
        "talker_temperature": dict(visible=shown),
    }


def control_values(session: ChatSession) -> dict[str, Any]:
    """Where the sampling controls start: the checkpoint's generation_config.json (greedy
    where it sets nothing), as the CLI and the server do for values left out."""
    initial = resolve({}, processor_state(session.processor).sampling_defaults).values
    return {
        "temperature": initial["temperature"],
        "top_p": max(0.05, initial["top_p"]),
        "repetition_penalty": min(2.0, max(1.0, initial["repetition_penalty"] or 1.0)),
        "max_tokens_cap": min(session.max_context or MAX_TOKENS_CAP, MAX_TOKENS_CAP),
    }


def build_app(models: ModelRegistry | ChatSession) -> gr.Blocks:
    """The page for ``models`` (or one loaded session); launch it with
    ``.queue().launch(...)``. It answers only with files uploaded through the page, each
    in its own conversation. Choosing another model loads it and starts a new
    conversation: the earlier turns may hold attachments the new model cannot take, and
    their answers were another model's."""
    registry = models if isinstance(models, ModelRegistry) else ModelRegistry.of_session(models)
    # Before any component: Gradio reads its upload folder when a component is made.
    uploads = process_uploads()
    first = registry.names[0]
    with registry.use(first) as session:
        session.uploads = uploads
        box, initial, panel = attachment_box(session), control_values(session), \
            model_markdown(session)
        hint = chat_hint(session)
        title, stats_text = f"mlxvlm · {session.model_name}", session.stats_markdown()
        speech = speech_controls(session)

    # The parameters' names are the /chat API's (gradio_client's keyword arguments).
    def respond(message, history, system_prompt, temperature, top_p, max_tokens,
                repetition_penalty, seed, model_name=None, speak_answers=True, voice=None,
                talker_temperature=TALKER_TEMPERATURE,
                request: gr.Request = None) -> Iterator[tuple[Any, str]]:
        # Before waiting for the model: a file named but not uploaded here loads nothing.
        uploads.admit(getattr(request, "session_hash", None), message, history)
        name = model_name or first
        wait = registry.wait_for(name)
        try:
            try:
                # Gradio closes a generator only between two items: yielding while the
                # model is not ours yet, a conversation whose client left stops waiting.
                while (chosen := wait.wait(YIELD_EVERY_S)) is None:
                    yield [], waiting_markdown(name)
            except PoolError as error:
                yield notice(str(error)), stale_markdown(None)
                return
            chosen.uploads = uploads  # every session reads only this page's uploads
            yield from chosen.respond(message, history, system_prompt, temperature, top_p,
                                      max_tokens, repetition_penalty, seed,
                                      speak=speak_answers, voice=voice,
                                      talker_temperature=talker_temperature,
                                      request=request)
        finally:
            wait.release()

    with gr.Blocks(title=title, analytics_enabled=False) as app:
        with gr.Row(equal_height=False):
            # The chat sits first (left) but is built last: ChatInterface must find its
            # controls already rendered, or it puts them in an accordion under the chat.
            chat_column = gr.Column(scale=3)
            with gr.Column(scale=1, min_width=280):
                # Shown with one model too: its label is the side panel's one heading.
                picker = gr.Dropdown(model_labels(registry.names), value=first, label="Model",
                                     interactive=len(registry.names) > 1,
                                     elem_id="model-picker")
                # Labels name these outputs in the API (gradio_client's view_api).
                model_panel = gr.Markdown(panel, label="Model details", elem_id="model-panel")
                stats = gr.Markdown(stats_text, label="Last answer's figures",
                                    elem_id="answer-stats")
                # A value: the API's system_prompt may be left out, as the page leaves it.
                system = gr.Textbox(value="", label="System prompt", lines=3,
                                    placeholder="(the model's default)")
                temperature = gr.Slider(0.0, 2.0, value=initial["temperature"], step=0.05,
                                        label="Temperature (0: greedy)")
                top_p = gr.Slider(0.05, 1.0, value=initial["top_p"], step=0.05, label="Top-p")
                cap = initial["max_tokens_cap"]
                max_tokens = gr.Slider(1, cap, value=min(256, cap), step=1,
                                       label="Max new tokens", elem_id="max-tokens")
                repetition_penalty = gr.Slider(1.0, 2.0, value=initial["repetition_penalty"],
                                               step=0.05, label="Repetition penalty (1: off)")
                seed = gr.Number(value=-1, precision=0, label="Seed (-1: random)")
                # A model that speaks: its answers' audio plays in the chat.
                speak = gr.Checkbox(value=True, label="Speak answers", elem_id="speak",
                                    **speech["speak"])
                # Any value reaches the chat function, which names the voices if it is
                # not one (the list is the model's, and an API client may switch models).
                voice = gr.Dropdown(label="Voice", elem_id="voice", allow_custom_value=True,
                                    **speech["voice"])
                talker_temperature = gr.Slider(
                    0.0, 2.0, value=TALKER_TEMPERATURE, step=0.05,
                    label="Speech temperature (0: greedy)", elem_id="talker-temperature",
                    **speech["talker_temperature"])

        with chat_column:
            textbox = gr.MultimodalTextbox(
                label="Message",
                show_label=False,
                file_count="multiple",
                stop_btn=True,  # a given textbox brings its own buttons
                elem_id="message",
                **box,
            )
            chat = gr.ChatInterface(
                respond,
                multimodal=True,
                chatbot=gr.Chatbot(label="Chat", height=560, elem_id="chat", placeholder=hint),
                textbox=textbox,
                additional_inputs=[
                    system, temperature, top_p, max_tokens, repetition_penalty, seed, picker,
                    speak, voice, talker_temperature,
                ],
                additional_outputs=[stats],
                api_name="chat",
                concurrency_limit=CONVERSATIONS_AT_ONCE,
                title=PAGE_HEADING,
                fill_height=True,
                analytics_enabled=False,
            )

        chosen_outputs = [model_panel, stats, textbox, temperature, top_p, max_tokens,
                          repetition_penalty, speak, voice, talker_temperature, chat.chatbot,
                          chat.chatbot_state, chat.chatbot_value]

        def choose(name: str):
            wait = registry.wait_for(name)
            try:
                while (chosen := wait.wait(YIELD_EVERY_S)) is None:  # as ``respond`` waits
                    yield (waiting_markdown(name),
                           *[gr.skip()] * (len(chosen_outputs) - 1))
                values, speech_of = control_values(chosen), speech_controls(chosen)
                yield (model_markdown(chosen), chosen.stats_markdown(),
                       gr.MultimodalTextbox(**attachment_box(chosen)),
                       gr.Slider(value=values["temperature"]),
                       gr.Slider(value=values["top_p"]),
                       gr.Slider(maximum=values["max_tokens_cap"],
                                 value=min(256, values["max_tokens_cap"])),
                       gr.Slider(value=values["repetition_penalty"]),
                       gr.Checkbox(**speech_of["speak"]),
                       gr.Dropdown(**speech_of["voice"]),
                       gr.Slider(**speech_of["talker_temperature"]),
                       gr.Chatbot(value=[], placeholder=chat_hint(chosen)), [], [])
            except PoolError as error:
                raise gr.Error(str(error)) from None
            finally:
                wait.release()

        picker.change(choose, [picker], chosen_outputs, api_name="choose_model")
    guard_file_handling(app, uploads)
    accept_text_messages(app)
    watch_upload_route(app, uploads)
    return app
