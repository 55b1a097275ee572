"""The engine: the cp mesh, argument validation, where tokens and heads live, the Ulysses exchange,
the ring, the kernels and the one attention pipeline that eager autograd, the compiled op and head
chunks share (docs/architecture.md). The public names are re-exported by `hybrid_cp`."""
