"""The algorithms as pure tensor math: round schedules, shard optimizers, codecs, error feedback."""
