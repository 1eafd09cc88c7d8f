"""Figures the benches print beside their own measurements, each with where it comes from.
These are not measurements of this machine: the benches label them as published or reference
figures, and every goal is a ratio measured within one run. docs/references.md tells the story.

The design article: the Chinese-language article this project's design follows (an inference
system built from first principles: kernels, model files, the engine, tracing, diff-based
evaluation). Its figures were measured on its own hardware (an A10G GPU for serving) and
workload; they are the targets our ratios are compared with.
"""

# Matrix multiply, 300 x 300 float64 (ms, effective GB/s, cache miss %), from the design article.
ARTICLE_MATMUL_300 = {"naive": (1800.0, 1.2, 92.7), "numpy": (2.0, 42.5, 8.3), "tiled": (3.8, 38.9, 11.2),
                      "cublas": (0.15, 720.0, None)}
ARTICLE_TILE = 24  # the article's advice: 24 x 24 tiles of float64 keep A, B and C tiles in L1

# Continuous vs static batching as served, from the design article.
ARTICLE_SERVING = {"static": {"qps": 89.0, "p99_ms": 113.0}, "continuous": {"qps": 127.0, "p99_ms": 42.0},
                   "kv_memory_less": 0.37}
