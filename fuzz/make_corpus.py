"""Writes the seed corpora under fuzz/corpus/TARGET/: tiny files of each format, written by the
reference libraries (gguf, safetensors, torch, tokenizers), and a few chat templates. Run it again
after a format change: `python fuzz/make_corpus.py`. Each seed is a few KiB at most."""

import io
import os
import sys
import zipfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _out(target: str, name: str, data: bytes) -> None:
    folder = os.path.join(HERE, "corpus", target)
    os.makedirs(folder, exist_ok=True)
    assert len(data) <= 8 << 10, f"{target}/{name} is {len(data)} bytes: a seed stays small"
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


def gguf_seeds(tmp: str) -> None:
    import gguf

    rng = np.random.default_rng(0)
    for name, arch, quant in (("f32.gguf", "llama", None), ("q8.gguf", "gpt2", gguf.GGMLQuantizationType.Q8_0),
                              ("q4.gguf", "llama", gguf.GGMLQuantizationType.Q4_1)):
        path = os.path.join(tmp, name)
        w = gguf.GGUFWriter(path, arch)
        w.add_uint32(f"{arch}.block_count", 1)
        w.add_array("tokenizer.ggml.tokens", ["a", "b", "ab"])
        w.add_string("tokenizer.chat_template", "{{ messages[0].content }}")
        w.add_tensor("f32", rng.standard_normal((2, 8)).astype(np.float32))
        w.add_tensor("f16", rng.standard_normal((3,)).astype(np.float16))
        if quant is not None:
            rows = rng.standard_normal((1, 256)).astype(np.float32)
            w.add_tensor("q", gguf.quants.quantize(rows, quant), raw_dtype=quant)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(path, "rb") as f:
            _out("gguf", name, f.read())


def safetensors_seeds(tmp: str) -> None:
    from safetensors.numpy import save

    rng = np.random.default_rng(0)
    _out("safetensors", "f32.safetensors", save({"a": rng.standard_normal((3, 4)).astype(np.float32),
                                                 "b": np.arange(5)}, metadata={"format": "pt"}))
    _out("safetensors", "mixed.safetensors", save({"h": np.ones(4, np.float16), "i": np.arange(3, dtype=np.int8),
                                                   "empty": np.zeros((0, 2), np.float32)}))


def torch_seeds(tmp: str) -> None:
    import torch

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    views = {"a": base, "t": base.t(), "row": base[1], "h": torch.ones(2, dtype=torch.bfloat16)}
    for name, obj in (("views.bin", views),
                      ("nested.bin", {"state_dict": {"w": torch.zeros(2, 2, dtype=torch.float16)}, "step": 3,
                                      "i": torch.tensor([1, 2], dtype=torch.int64)})):
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = buf.getvalue()
        _out("torch", name, data)
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
            _out("unpickle", name.replace(".bin", ".pkl"), z.read(pkl))


def tokenizer_seeds(tmp: str) -> None:
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    vocab = {"a": 0, "b": 1, "ab": 2, "Ġ": 3, "Ġa": 4, "<s>": 5}
    bpe = tokenizers.Tokenizer(models.BPE(vocab, [("a", "b"), ("Ġ", "a")]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(["<s>"])
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 5)])
    _out("tokenizer_json", "bpe.json", bpe.to_str().encode())
    split = tokenizers.Tokenizer(models.BPE({"a": 0, "1": 1, " ": 2}, []))
    split.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(" ", "Ġ")])
    split.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                   pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)])
    split.decoder = decoders.ByteLevel()
    _out("tokenizer_json", "bpe-split.json", split.to_str().encode())
    pieces = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "he": 3, "##llo": 4}
    wp = tokenizers.Tokenizer(models.WordPiece(pieces, unk_token="[UNK]"))
    wp.normalizer = normalizers.BertNormalizer(lowercase=True)
    wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wp.decoder = decoders.WordPiece()
    wp.post_processor = processors.BertProcessing(("[SEP]", 2), ("[CLS]", 1))
    _out("tokenizer_json", "wordpiece.json", wp.to_str().encode())


TEMPLATES = {
    "chatml.jinja": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                    "{% endif %}",
    "gemma.jinja": "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'assistant') %}"
                   "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
                   "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}",
    "llama.jinja": "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                   "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
                   "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                   "{{ content }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    "tools.jinja": "{%- set ns = namespace(sys='') %}{%- for m in messages %}{%- if m.role == 'system' %}"
                   "{%- set ns.sys = ns.sys ~ m.content %}{%- endif %}{%- endfor %}{{ ns.sys|tojson(indent=2) }}"
                   "{% macro say(m) %}[{{ m.role|upper }}] {{ m.content|replace('a', 'b')|center(20) }}{% endmacro %}"
                   "{% for m in messages if m.role != 'system' %}{{ say(m) }}{{ '%s/%d' % (m.role, loop.length) }}"
                   "{{ loop.cycle('-', '+') }}{% endfor %}{{ range(3)|map('string')|join(',') }}"
                   "{{ '{0:>4}'.format(messages|length) }}{{ (messages|map(attribute='role')|list)[:2] }}",
}


def template_seeds(tmp: str) -> None:
    for name, text in TEMPLATES.items():
        _out("chat_template", name, text.encode())


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for make in (gguf_seeds, safetensors_seeds, torch_seeds, tokenizer_seeds, template_seeds):
            make(tmp)
    for target in sorted(os.listdir(os.path.join(HERE, "corpus"))):
        folder = os.path.join(HERE, "corpus", target)
        print(target, {n: os.path.getsize(os.path.join(folder, n)) for n in sorted(os.listdir(folder))})
