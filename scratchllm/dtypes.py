"""The weight dtypes a model can be loaded with (`load_model(ref, dtype=)`, `--dtype`), in one
place with no imports, so the command line can offer them without loading NumPy."""

WEIGHT_DTYPES = ("float32", "bfloat16", "quantized")  # how a loaded model's matrices are stored
DTYPES = ("auto", *WEIGHT_DTYPES)  # what a user may ask for: "auto" picks one of WEIGHT_DTYPES per file
DEFAULT_DTYPE = "auto"
DTYPE_HELP = ("weight matrices: auto (default: quantized for a Llama GGUF file with Q8_0/Q4_0/Q4_1 blocks, "
              "float32 otherwise; the same logits as float32 either way); float32 (the reference's numbers); "
              "bfloat16 (Llama; about 1.7x faster matmuls with AVX512-BF16, logits differ in the third digit); "
              "quantized (Llama from a GGUF file: keeps its Q8_0/Q4_0/Q4_1 blocks, a third of float32's bytes, "
              "the same logits bit for bit)")
