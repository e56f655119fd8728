"""MLX's CPU backend, made fast: everything mlxvlm does only where MLX computes on the CPU.

Importing this package imports nothing else (no MLX): ``mlxvlm.process_setup`` loads the
BLAS shim from here before MLX itself is imported.
"""
