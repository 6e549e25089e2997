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
- ``quality``: the loss per sample against AdamW, and the samples to AdamW's loss, from the
  results folder the caller names (never found from the source tree);
- ``recommend``: the rows, the recommendation (AdamW's class, fitting) and the soonest to AdamW's loss;
- ``probe``: ``--measure``, timed collectives and micro-batches on the running cluster.

Predicted against measured on the testbed: benchmarks/plan_validate.py; the
projections of docs/planning.md: benchmarks/projections.py.
"""
