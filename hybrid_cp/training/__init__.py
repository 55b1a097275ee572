"""Training helpers on top of the engine: `shard_batch`, the cp cross entropy, tiled loss and MLP, and
the memory meter, sharded checkpoints (docs/training.md, docs/memory.md). The public names are re-exported by `hybrid_cp`."""
