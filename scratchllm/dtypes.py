"""The weight dtypes a model can be loaded with (`load_model(ref, dtype=)`, `--dtype`), in one
place with no imports, so the command line can offer them without loading NumPy."""

DTYPES = ("float32", "bfloat16", "quantized")
DTYPE_HELP = ("weight matrices: float32 (default, the reference's numbers); bfloat16 (Llama; about 1.7x faster "
              "matmuls with AVX512-BF16, logits differ in the third digit); quantized (Llama from a GGUF file: "
              "keeps its Q8_0/Q4_0/Q4_1 blocks, a third of float32's bytes, the same logits bit for bit)")
