"""Retrieval: embeddings and reranking with vision-language models (see ``use.py`` for
the interface a model's retrieval use implements and ``detection.py`` for how loading
finds it)."""
