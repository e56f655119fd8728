"""The Gradio chat UI: ``python -m mlxvlm.ui --model M [--model M2 ...]``.

``media_kinds``  which attachments a model takes (images, PDFs, videos, audio; one row per kind)
``conversation`` Gradio's chat history -> mlxvlm chat messages
``session``      the model behind the chat: one answer at a time, streaming, stop, stats
``thoughts``     a thinking model's thoughts in a folded box, apart from its answer
``spoken_answers`` a speaking model's answers: written, then spoken with the model held
                 alone; the audio as a WAV message the chat plays; the speech controls
``models``       the models the chat offers, loaded when chosen (at most N at a time),
                 switched fairly between conversations (``model_pool``, as the server)
``uploads``      which files the chat may read: uploads only, each by its conversation
``fields``       Gradio's file handling on the page, held to those uploads
``api_inputs``   the chat's API takes a plain-text message too
``app``          the Gradio page
``__main__``     the command line
"""
