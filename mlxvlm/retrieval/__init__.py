"""Retrieval: embeddings and reranking with vision-language models.

``use.py``: the interface a model's retrieval use implements; ``detection.py``: how
loading finds it; ``api.py``: ``embed`` and ``rerank`` (exported as ``mlxvlm.embed`` and
``mlxvlm.rerank``); ``inputs.py``: what callers pass, normalised; ``scoring.py``:
MaxSim and the dot product; one module per model group's use (``colvision.py``).
"""
