"""The compute loops that drive a strategy's rounds. A strategy builds its loop from the
engine's parts (``Strategy.make_loop(parts)``, ``parts.LoopParts``): sharded rounds
(``sharded.ShardedLoop``: zero1, dpu, acco, local_sgd, onebit_adam) or local steps
(``local_steps.LocalStepsLoop``: diloco, sparseloco). A strategy of another shape brings a
``RoundLoop`` subclass of its own (``base.RoundLoop``: ``submit_round`` and ``record``)."""
