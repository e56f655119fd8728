"""``python -m mlxvlm.embed``: the retrieval command (``__main__.py``). The package holds
nothing else: ``mlxvlm.embed`` is the Python API's function (``mlxvlm.retrieval.api``),
bound after this package is imported, as ``mlxvlm.generate`` is."""
