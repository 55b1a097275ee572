"""Integrations with model libraries: transformers (attention registry) and FSDP2 over dp x cp.

Import the submodules directly (they import their libraries lazily):
`hybrid_cp.integrations.transformers.apply_context_parallel`,
`hybrid_cp.integrations.fsdp.shard_model`.
"""
