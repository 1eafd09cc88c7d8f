"""Write a Llama-shaped GGUF file with random weights: the scale row of `bench peers`.

    python scripts/make_random_gguf.py out/llama-1b-q4_0.gguf            # ~1.1B parameters
    python scripts/make_random_gguf.py out/tiny.gguf --size tiny

Layer matrices are Q4_0 and the (tied) embedding Q8_0, quantized by the `gguf` package (a test
requirement); norms are ones. The tokenizer is copied from the default model's GGUF, so the
vocabulary (49152) is SmolLM2's and both runtimes can load the file. Random weights make
meaningless text, but every byte is read and multiplied as in a trained model of the shape:
the cost of growth is measured, not guessed.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

# TinyLlama-1.1B's shape (vocabulary aside); "tiny" for tests
SIZES = {"1b": {"hidden": 2048, "intermediate": 5632, "layers": 22, "heads": 32, "kv_heads": 4},
         "tiny": {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2}}


def write_random_llama_gguf(path, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                            tokenizer_from, layer_type: str = "Q4_0", embed_type: str = "Q8_0", seed: int = 0):
    import gguf

    reader = gguf.GGUFReader(str(tokenizer_from))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"random-llama-{hidden}x{layers}")
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    rng = np.random.default_rng(seed)

    def matrix(name, rows, cols, type_name):
        w = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)
        qtype = gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    D = hidden // heads
    matrix("token_embd.weight", vocab, hidden, embed_type)  # tied: also the LM head
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(b + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv_heads * D, hidden),
                                 ("attn_v", kv_heads * D, hidden), ("attn_output", hidden, hidden),
                                 ("ffn_gate", intermediate, hidden), ("ffn_up", intermediate, hidden),
                                 ("ffn_down", hidden, intermediate)):
            matrix(b + name + ".weight", rows, cols, layer_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--size", choices=SIZES, default="1b")
    parser.add_argument("--layer-type", choices=["Q4_0", "Q4_1", "Q8_0"], default="Q4_0")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from scratchllm.formats.refs import resolve_model

    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_random_llama_gguf(args.out, **SIZES[args.size], tokenizer_from=resolve_model("default"),
                            layer_type=args.layer_type, seed=args.seed)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
