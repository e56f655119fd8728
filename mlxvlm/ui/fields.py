"""Gradio's file handling on the chat page, restricted to files uploaded through it.

Gradio copies, or downloads, every file a request names in any input field, whatever the
component (a system-prompt textbox or the chat's saved-conversations store as well as the
attachment box), through the component's ``async_move_resource_to_block_cache`` (after
refusing local paths outside its upload folder, but not URLs). ``guard_file_handling``
makes that method refuse, before any copy or download, every file that did not come
through the upload route (see ``uploads``).

Chatbots also refuse "component" messages: Gradio builds the named component from one
and runs its ``preprocess`` on the client's value unchecked (``gr.Image`` opens any image
path on the host and re-encodes it into the cache). The app never shows one.

Both are set on the instances, not in subclasses: Gradio writes a ``.pyi`` file next to
the module of every component subclass when it is defined. An event that updates a
component's properties (the model picker sets the attachment box's file types) gives the
conversation a new instance of it, built from the constructor's arguments: each is
guarded too, before a request's inputs are read.
"""

from __future__ import annotations

import gradio as gr
from gradio.blocks import Block, Blocks

from mlxvlm.ui.uploads import AttachmentRefused, Uploads


GUARDED = "_mlxvlm_guarded"


def _guard(block: Block, uploads: Uploads) -> None:
    if getattr(block, GUARDED, False):
        return
    setattr(block, GUARDED, True)
    move, async_move = block.move_resource_to_block_cache, block.async_move_resource_to_block_cache

    def checked_move(url_or_file_path):
        uploads.require_upload(url_or_file_path)
        return move(url_or_file_path)

    async def checked_async_move(url_or_file_path):
        uploads.require_upload(url_or_file_path)
        return await async_move(url_or_file_path)

    # On the instance: Gradio calls these on the block that receives the value.
    block.move_resource_to_block_cache = checked_move
    block.async_move_resource_to_block_cache = checked_async_move

    if isinstance(block, gr.Chatbot):
        preprocess_content = block._preprocess_content

        def no_components(chat_message):
            if getattr(chat_message, "type", None) == "component":
                raise AttachmentRefused()
            return preprocess_content(chat_message)

        block._preprocess_content = no_components


def guard_file_handling(app: Blocks, uploads: Uploads) -> None:
    """Every component of ``app`` accepts only uploaded files (call once it is built)."""
    for block in app.blocks.values():
        _guard(block, uploads)
    preprocess_data = app.preprocess_data

    async def guarded_preprocess_data(block_fn, inputs, state, *args, **kwargs):
        # The conversation's own instances of updated components (see the top).
        for block in block_fn.inputs:
            if state is not None and not block.stateful and block._id in state:
                _guard(state[block._id], uploads)
        return await preprocess_data(block_fn, inputs, state, *args, **kwargs)

    app.preprocess_data = guarded_preprocess_data
