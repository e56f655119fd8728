"""The chat's two file-carrying fields, restricted to files uploaded through the page.

Gradio copies or downloads the files named in a request field through the field's
``async_move_resource_to_block_cache`` (after refusing paths outside its upload folder):
these fields refuse there, before any copy or download, every file that did not come
through the upload route (see ``uploads``). The chatbot also refuses "component"
messages: Gradio builds the named component from them and runs its ``preprocess`` on the
client's value, unchecked (``gr.Image`` opens and re-encodes any image path on the host
into the cache). The app never shows one.
"""

from __future__ import annotations

import gradio as gr
from gradio.data_classes import GradioModel

from mlxvlm.ui.uploads import AttachmentRefused, Uploads


class UploadsOnlyTextbox(gr.MultimodalTextbox):
    is_template = True  # the page draws it as the MultimodalTextbox it is

    def __init__(self, *args, uploads: Uploads, **kwargs):
        self.uploads = uploads
        super().__init__(*args, **kwargs)

    async def async_move_resource_to_block_cache(self, url_or_file_path):
        self.uploads.require_upload(url_or_file_path)
        return await super().async_move_resource_to_block_cache(url_or_file_path)

    def move_resource_to_block_cache(self, url_or_file_path):
        self.uploads.require_upload(url_or_file_path)
        return super().move_resource_to_block_cache(url_or_file_path)


class UploadsOnlyChatbot(gr.Chatbot):
    is_template = True

    def __init__(self, *args, uploads: Uploads, **kwargs):
        self.uploads = uploads
        super().__init__(*args, **kwargs)

    async def async_move_resource_to_block_cache(self, url_or_file_path):
        self.uploads.require_upload(url_or_file_path)
        return await super().async_move_resource_to_block_cache(url_or_file_path)

    def move_resource_to_block_cache(self, url_or_file_path):
        self.uploads.require_upload(url_or_file_path)
        return super().move_resource_to_block_cache(url_or_file_path)

    def _preprocess_content(self, chat_message: GradioModel):
        if getattr(chat_message, "type", None) == "component":
            raise AttachmentRefused()
        return super()._preprocess_content(chat_message)
