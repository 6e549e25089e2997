"""The checkpoints: writing, periodic saves, peers' copies, loading, and the re-cut at another world size."""
