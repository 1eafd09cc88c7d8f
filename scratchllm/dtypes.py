"""The weight dtypes a model can be loaded with (`load_model(ref, dtype=)`, `--dtype`), in one
place with no imports, so the command line can offer them without loading NumPy."""

WEIGHT_DTYPES = ("float32", "bfloat16", "quantized")  # how a loaded model's matrices are stored
# What a user may ask for: "auto" picks one per file; "int8" and "int16" store the matrices
# "quantized" and multiply them by x rounded to integers (ACTIVATIONS below), the others multiply
# by float32 x.
DTYPES = ("auto", *WEIGHT_DTYPES, "int8", "int16")
DEFAULT_DTYPE = "auto"
# How a quantized matrix multiplies x: "float32" (each weight turned into its exact float32 value:
# the dequantized float32 model's logits, bit for bit), or x rounded to integers per 32 values and
# integer dot products: "int8" (llama.cpp's arithmetic: the fastest, logits close to float32's) or
# "int16" (16 bits as two 8-bit levels, two dot products per weight byte: logits about 256 times
# closer, nearly as fast where memory binds)
ACTIVATIONS = ("float32", "int8", "int16")
DTYPE_HELP = ("weight matrices: auto (default: for a Llama GGUF file with quantized blocks, where the CPU "
              "has VNNI dot products, int8 for models of 0.4B parameters or more and int16 below, quantized "
              "on other CPUs; float32 otherwise); float32 (the reference's "
              "numbers); bfloat16 (Llama; about 1.7x faster matmuls with AVX512-BF16, logits differ in the "
              "third digit); quantized (Llama from a GGUF file: keeps its quantized blocks, exact float32 "
              "products: the dequantized float32 model's logits bit for bit); int16 (the same blocks times "
              "activations rounded to 16 bits per 32 values, integer dot products: faster, logits within "
              "about 1e-3 of float32's); int8 (activations rounded to 8 bits, as llama.cpp does: the fastest, "
              "logits within a few percent)")


def storage(dtype: str) -> tuple[str, str]:
    """A resolved dtype (not "auto") -> (how the matrices are stored: one of WEIGHT_DTYPES, how
    quantized matrices multiply x: one of ACTIVATIONS)."""
    if dtype in ACTIVATIONS[1:]:  # int8, int16
        return "quantized", dtype
    assert dtype in WEIGHT_DTYPES, dtype
    return dtype, "float32"
