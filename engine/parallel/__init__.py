"""Where the ranks sit and the engine's process groups (ParallelDims)."""
