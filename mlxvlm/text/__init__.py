"""Text in and out of a model: the tokenizer a processor carries and its stop ids
(``tokenization``), the streaming detokenizer (``detokenizer``), and an answer split into
reasoning, content and tool calls by the chat template's formats (``answer_parts``), which
the server and the chat UI share."""
