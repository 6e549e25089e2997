"""The planner (`python -m engine.plan`, docs/planning.md): from a model, a cluster and a
batch it predicts, for every strategy and codec, the step time, the bytes per node link, the
memory per GPU, the measured loss per sample and the time to AdamW's loss, and recommends one. One job per file:

- ``shape``: the model's parameter counts (a transformers config or a stated shape);
- ``modes``: the candidates, every registered strategy with a spec (engine/strategies/spec.py:
  the strategies own their facts; no file here names one), with codecs, exchanges, model sharding;
- ``wire``: bytes per step and link class, from the strategies' own byte formulas
  (the memory sections of docs/design/ and of the strategies' topic files);
- ``hardware``: compute and comm-side costs (GPU node, or the CPU testbed's measured constants);
- ``timeline``: a step's time from the strategy's round plan;
- ``memory``: the training state per GPU; ``activations``: one micro-batch's, with and without
  checkpointing; ``fit``: whether both fit the GPU; ``advice``: what would, when nothing does;
- ``quality``: reading the benchmark JSONs of the results folder the caller names (never found from
  the source tree): which mode a row ran, DDP's held-out set, a run's samples to AdamW's loss;
- ``evidence``: each mode's measured rows (>= 3 seeds, the loss grid's >= 2) and its loss per sample
  and samples factor at the run's B and length, interpolated, never extrapolated;
- ``goal``: the user's goal (keep AdamW's loss per sample within a bound, or reach it soonest);
- ``decide``: the one decision rule, strategy="auto"'s and the recommendation's;
- ``recommend``: the rows, the recommendation (``decide`` for the goal) and the soonest to AdamW's loss;
- ``probe``: ``--measure``, timed collectives and micro-batches on the running cluster.

Predicted against measured on the testbed: benchmarks/plan_validate.py; the
projections of docs/planning.md: benchmarks/projections.py.
"""
