"""Sharded inference over MLX's distributed engine (``mx.distributed`` under
``mlx.launch``: ring over TCP, JACCL over Thunderbolt RDMA, MPI).

``group`` finds the launched group and names what each rank holds; ``sharding`` splits
the language model (tensor parallel: a slice of every attention and MLP; pipeline: a run
of layers) before its weights are read, so that each rank reads only its shard;
``broadcast`` carries rank 0's request (prompt ids, the towers' embeddings and the
decoder's state) and each sampled token to the other ranks; ``follower`` is what the
other ranks run instead of the CLI's output or the server's HTTP.
"""
