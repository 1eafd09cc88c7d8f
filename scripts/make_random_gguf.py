"""Write a Llama-shaped GGUF file with random weights: the scale row of `bench peers`, and test files.

    python scripts/make_random_gguf.py out/llama-1b-q4_0.gguf            # ~1.1B parameters
    python scripts/make_random_gguf.py out/tiny.gguf --size tiny
    python scripts/make_random_gguf.py out/small-q4_k_m.gguf --size small --quant-mix q4_k_m
    python scripts/make_random_gguf.py out/tiny.gguf --size tiny --split-max-tensors 7   # 3 shards
    python scripts/make_random_gguf.py /big/disk/qwen-7b-q4_k_m.gguf --size 7b --quant-mix q4_k_m   # ~4.4 GB

Quantization mixes (--quant-mix):
  q4_0    (default) layer matrices Q4_0 (--layer-type), the tied embedding Q8_0.
  q4_k_m  llama.cpp's Q4_K_M recipe: Q4_K for most matrices; Q6_K for attn_v and ffn_down on the
          layers llama.cpp gives more bits (the first and last eighth, and every third between),
          and for output.weight (untied); token_embd Q4_K.
  every   each layer matrix in turn one of Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
          IQ4_XS (so fused q|k|v and gate|up mix types); the tied embedding Q6_K.
As llama.cpp does, a matrix whose rows are not a whole number of 256-element blocks falls back
from a K-quant to a 32-block type (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, others -> IQ4_NL).

Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 are quantized from Gaussian weights by the `gguf` package (a
test requirement). The types it cannot quantize (K-quants, IQ4) are random but valid blocks:
random bytes, with each block's float16 scales set to finite values that give weights of about
the size of the others. Norms are ones. The tokenizer is copied from the default model's GGUF,
so the vocabulary (49152) is SmolLM2's and both runtimes can load the file (or, with
`tokenizer_from=None`, no tokenizer and a `vocab` of your choice: enough to load the weights);
`--size 7b` (Qwen2.5-7B's shape: hidden 3584, intermediate 18944, 28 layers, 28 heads, 4 KV
heads) copies Qwen2.5-Coder's tokenizer instead, for its vocabulary of 151,936 (the package model
qwen2.5-coder-1.5b). Tensors are made and written one at a time, so the 7B's 4.4 GB never sit
in memory at once.
Random weights make meaningless text, but every byte is read and multiplied as in a trained
model of the shape: the cost of growth is measured, not guessed.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

# TinyLlama-1.1B's shape (vocabulary aside); Qwen2.5-7B's (no q|k|v biases; the vocabulary: its
# tokenizer, TOKENIZER); "tiny" and "small" (rows of whole K-quant blocks) for tests
SIZES = {"1b": {"hidden": 2048, "intermediate": 5632, "layers": 22, "heads": 32, "kv_heads": 4},
         "7b": {"hidden": 3584, "intermediate": 18944, "layers": 28, "heads": 28, "kv_heads": 4},
         "small": {"hidden": 256, "intermediate": 512, "layers": 4, "heads": 4, "kv_heads": 2},
         "tiny": {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2}}

QUANT_MIXES = ("q4_0", "q4_k_m", "every")
TOKENIZER = {"7b": "qwen2.5-coder-1.5b"}  # the model reference whose tokenizer a size copies (else "default")
EVERY = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
GGUF_QUANTIZES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # the types gguf.quants.quantize implements
FALLBACK_32 = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL"}

# Random blocks: byte offsets of each float16 scale field in the block, and the size of the
# typical |q * sub-block scale| that the first of them multiplies (so weights come out ~0.02);
# a second field (a min: Dmin, or Q4_1/Q5_1's m) is set relative to the first.
SCALE_FIELDS = {"Q2_K": ((80, 82), 16), "Q3_K": ((108,), 40), "Q4_K": ((0, 2), 256), "Q5_K": ((0, 2), 512),
                "Q6_K": ((208,), 1500), "IQ4_NL": ((0,), 60), "IQ4_XS": ((0,), 1000)}
MIN_OVER_SCALE = {"Q2_K": 1.5, "Q4_K": 8.0, "Q5_K": 16.0}  # Dmin / D: mins that roughly centre the weights


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in *_K_M mixes."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def mix_type(mix: str, name: str, layer: int | None, index: int, layers: int, layer_type: str) -> str:
    """The GGML type of tensor `name` (of block `layer`, the `index`-th layer matrix) in a mix."""
    if mix == "q4_0":
        return "Q8_0" if name == "token_embd" else layer_type
    if mix == "q4_k_m":
        if name == "output":
            return "Q6_K"
        if name in ("attn_v", "ffn_down") and use_more_bits(layer, layers):
            return "Q6_K"
        return "Q4_K"
    if mix == "every":
        return "Q6_K" if name == "token_embd" else EVERY[index % len(EVERY)]
    raise ValueError(f"unknown quantization mix {mix!r}; choose from {', '.join(QUANT_MIXES)}")


def random_blocks(type_name: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random valid blocks of a [rows, cols] tensor: uint8 [rows, cols / block * block bytes]."""
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    n = rows * cols // block
    raw = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    offsets, product = SCALE_FIELDS[type_name]
    d = (rng.uniform(0.5, 1.5, n) * 0.02 / product).astype(np.float16)
    raw[:, offsets[0]:offsets[0] + 2] = d.view(np.uint8).reshape(n, 2)
    if len(offsets) > 1:
        dmin = (d.astype(np.float32) * MIN_OVER_SCALE[type_name]).astype(np.float16)
        raw[:, offsets[1]:offsets[1] + 2] = dmin.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def _copy_tokenizer(reader, writer):
    """Every tokenizer.* key of the file `reader` reads, into `writer`'s, with its GGUF type."""
    import gguf

    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), kind, sub_type=sub)


def write_random_llama_gguf(path, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                            tokenizer_from=None, layer_type: str = "Q4_0", embed_type: str = "Q8_0", seed: int = 0,
                            quant_mix: str = "q4_0", vocab: int | None = None, split_max_tensors: int = 0):
    """The file at `path`; `tokenizer_from`: a GGUF whose tokenizer (and vocabulary size) to copy, or
    None for no tokenizer and `vocab` tokens. `quant_mix`: see the module docstring ("q4_0" takes
    `layer_type`, and `embed_type` for the tied embedding). `split_max_tensors`: a split model
    instead, shards of at most that many tensors named as llama.cpp's gguf-split names them
    (PATH's stem-00001-of-0000N.gguf, ...; the gguf package's split writer); returns the first's path."""
    import gguf

    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    if tokenizer_from is not None:
        reader = gguf.GGUFReader(str(tokenizer_from))
        vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    elif vocab is None:
        raise ValueError("without tokenizer_from, say the vocabulary size (vocab)")
    writer.add_name(f"random-llama-{hidden}x{layers}-{quant_mix}")
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
    if tokenizer_from is not None:
        _copy_tokenizer(reader, writer)
    rng = np.random.default_rng(seed)
    plan = []  # (name, rows, cols, type name) of every tensor in file order; "F32": a norm of ones

    def matrix(name, rows, cols, type_name):
        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
        if cols % block:  # llama.cpp's fallback for rows of partial 256-blocks
            type_name = FALLBACK_32[type_name]
            block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
        writer.add_tensor_info(name, (rows, cols // block * nbytes), np.dtype(np.uint8), rows * cols // block * nbytes,
                               raw_dtype=gguf.GGMLQuantizationType[type_name])
        plan.append((name, rows, cols, type_name))

    def ones(name, n):
        writer.add_tensor_info(name, (n,), np.dtype(np.float32), 4 * n)
        plan.append((name, n, 1, "F32"))

    def made(rows, cols, type_name):  # the tensor's data, drawn from rng in file order
        if type_name == "F32":
            return np.ones(rows, dtype=np.float32)
        if type_name in GGUF_QUANTIZES:
            w = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
            return gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
        return random_blocks(type_name, rows, cols, rng)

    D = hidden // heads
    tied = quant_mix != "q4_k_m"
    matrix("token_embd.weight", vocab, hidden,
           embed_type if quant_mix == "q4_0" else mix_type(quant_mix, "token_embd", None, 0, layers, layer_type))
    if not tied:
        matrix("output.weight", vocab, hidden, mix_type(quant_mix, "output", None, 0, layers, layer_type))
    ones("output_norm.weight", hidden)
    index = 0
    for i in range(layers):
        b = f"blk.{i}."
        ones(b + "attn_norm.weight", hidden)
        ones(b + "ffn_norm.weight", hidden)
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv_heads * D, hidden),
                                 ("attn_v", kv_heads * D, hidden), ("attn_output", hidden, hidden),
                                 ("ffn_gate", intermediate, hidden), ("ffn_up", intermediate, hidden),
                                 ("ffn_down", hidden, intermediate)):
            matrix(b + name + ".weight", rows, cols, mix_type(quant_mix, name, i, index, layers, layer_type))
            index += 1
    first = writer.format_shard_names(path)[0]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, rows, cols, type_name in plan:
        writer.write_tensor_data(made(rows, cols, type_name))
    writer.close()
    return first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--size", choices=SIZES, default="1b",
                        help="1b: TinyLlama-1.1B's shape; 7b: Qwen2.5-7B's, with Qwen's tokenizer; tiny, small: tests")
    parser.add_argument("--quant-mix", choices=QUANT_MIXES, default="q4_0")
    parser.add_argument("--layer-type", choices=["Q4_0", "Q4_1", "Q8_0"], default="Q4_0", help="of the q4_0 mix")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split-max-tensors", type=int, default=0, metavar="N",
                        help="write a split model: shards of at most N tensors, OUT's stem-00001-of-0000K.gguf, ...")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from scratchllm.formats.refs import resolve_model

    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = resolve_model(TOKENIZER.get(args.size, "default"))
    first = write_random_llama_gguf(args.out, **SIZES[args.size], tokenizer_from=tokenizer,
                                    layer_type=args.layer_type, seed=args.seed, quant_mix=args.quant_mix,
                                    split_max_tensors=args.split_max_tensors)
    shards = " and its other shards" if first != args.out else ""
    print(f"wrote {first} ({first.stat().st_size / 1e6:.0f} MB){shards}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
