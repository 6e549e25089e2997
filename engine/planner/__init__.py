"""The planner (`python -m engine.plan`, docs/DESIGN.md section 12): from a model, a cluster and a
batch it predicts, for every strategy and codec, the step time, the bytes per node link, the
memory per GPU, the measured loss per sample and the time to AdamW's loss, and recommends one. One job per file:

- ``shape``: the model's parameter counts (a transformers config or a stated shape);
- ``modes``: the strategies and codecs the planner compares (names as the engine spells them);
- ``wire``: bytes per step and link class, from the engine's own byte formulas (docs/DESIGN.md 3, 8, 9);
- ``hardware``: compute and comm-side costs (GPU node, or the CPU testbed's measured constants);
- ``timeline``: a step's time from the strategy's round timeline;
- ``memory``: bytes per GPU;
- ``quality``: the loss per sample against AdamW, and the samples to AdamW's loss, from docs/results;
- ``plan``: the rows, the recommendation (AdamW's class) and the soonest to AdamW's loss;
- ``validate``: predicted against measured on the testbed JSONs;
- ``probe``: ``--measure``, timed collectives and micro-batches on the running cluster.
"""
