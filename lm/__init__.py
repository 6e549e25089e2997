"""Language-model data and models for the recipes, tests and benchmarks: text corpora, tokenized
micro-batch streams and held-out evaluation (``lm.data``), model loading through transformers,
GGUF de-quantization, a tiny GPT-2 and a tiny Llama (``lm.models``), the calibration statistics
of a low-bit export (``lm.calibration``) and the files an export writes and loads
(``lm.quantized_files``). The engine does not import this package: it trains any
``torch.nn.Module``."""
