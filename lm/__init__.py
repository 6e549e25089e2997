"""Language-model data and models for the recipes, tests and benchmarks: text corpora, tokenized
micro-batch streams and held-out evaluation (``lm.data``), and model loading through
transformers, GGUF de-quantization and a tiny GPT-2 (``lm.models``). The engine does not import
this package: it trains any ``torch.nn.Module``."""
