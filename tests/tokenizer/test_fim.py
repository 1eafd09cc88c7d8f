"""Fill-in-the-middle layouts: each family's prompt written out as the text its documentation
gives (the model cards' and papers' formats, quoted below), the family found from its token
texts or from the ids a GGUF file declares, and the 400-worthy error naming what a model lacks.
The real Qwen2.5-Coder file's ids against transformers' tokenizer: tests/server/test_fim_real.py."""

import pytest

from scratchllm.tokenizer.fim import FimUnsupported, RepoFile, find_layout
from scratchllm.tokenizer.gguf_meta import fim_ids

QWEN = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
        "<|file_sep|>"]
STARCODER2 = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<repo_name>", "<file_sep>"]
CODEGEMMA = ["<eos>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|file_separator|>"]
DEEPSEEK = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>"]
CODELLAMA = ["<s>", "</s>", "▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"]
FILES = [RepoFile("src/util.py", "def sub(a, b):\n    return a - b\n"), RepoFile("README.md", "Arithmetic.")]


class Vocab:
    """Special tokens at ids 0..n-1; every other character is one token, 1000 + its code point."""

    def __init__(self, specials, bos=None):
        self.specials, self.bos_token_id = specials, bos

    def token_to_id(self, token):
        return self.specials.index(token) if token in self.specials else None

    def id_to_token(self, i):
        return self.specials[i] if i < 1000 else chr(i - 1000)

    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return [1000 + ord(c) for c in text]

    def text(self, ids):
        return "".join(self.id_to_token(i) for i in ids)


def written(vocab, prefix="def f(x):\n    ", suffix="\n    return y\n", files=(), declared=None):
    layout = find_layout(vocab, declared)
    return layout, vocab.text(layout.prompt_ids(vocab, prefix, suffix, files, "myrepo", "src/main.py"))


def test_qwen_file_level_and_its_repository_format():
    # Qwen2.5-Coder: <|fim_prefix|>{code_pre}<|fim_suffix|>{code_suf}<|fim_middle|>, and the report's repo-level
    # format: <|repo_name|>{repo_name}\n<|file_sep|>{file_path1}\n{file_content1}\n ... <|file_sep|>{file_path3}\n
    vocab = Vocab(QWEN)
    layout, text = written(vocab)
    assert layout.family == "qwen2.5-coder"
    assert text == "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y\n<|fim_middle|>"
    assert [vocab.id_to_token(i) for i in layout.end_ids] == ["<|endoftext|>", "<|fim_pad|>", "<|repo_name|>",
                                                              "<|file_sep|>"]
    _, text = written(vocab, files=FILES)
    assert text == ("<|repo_name|>myrepo\n<|file_sep|>src/util.py\ndef sub(a, b):\n    return a - b\n"
                    "<|file_sep|>README.md\nArithmetic.\n<|file_sep|>src/main.py\n"
                    "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y\n<|fim_middle|>")


def test_starcoder2_repository_format_puts_the_path_after_fim_prefix():
    # StarCoder2 (its paper): <repo_name>reponame<file_sep>filepath0\ncode0<file_sep><fim_prefix>filepath1\n
    # code1_pre<fim_suffix>code1_suf<fim_middle>
    layout, text = written(Vocab(STARCODER2), files=FILES[:1])
    assert layout.family == "starcoder2"
    assert text == ("<repo_name>myrepo<file_sep>src/util.py\ndef sub(a, b):\n    return a - b\n"
                    "<file_sep><fim_prefix>src/main.py\ndef f(x):\n    <fim_suffix>\n    return y\n<fim_middle>")
    assert written(Vocab(STARCODER2))[1] == "<fim_prefix>def f(x):\n    <fim_suffix>\n    return y\n<fim_middle>"


def test_codegemma_is_told_from_qwen_by_its_file_separator():
    vocab = Vocab(CODEGEMMA)
    layout, text = written(vocab)
    assert layout.family == "codegemma"
    assert text == "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y\n<|fim_middle|>"
    assert [vocab.id_to_token(i) for i in layout.end_ids] == ["<|file_separator|>", "<eos>"]
    assert written(vocab, files=FILES[:1])[1].startswith("src/util.py\ndef sub(a, b):\n    return a - b\n"
                                                         "<|file_separator|><|fim_prefix|>")


@pytest.mark.parametrize("specials,family,text", [
    (DEEPSEEK, "deepseek-coder",
     "<｜begin▁of▁sentence｜><｜fim▁begin｜>def f(x):\n    <｜fim▁hole｜>\n    return y\n<｜fim▁end｜>"),
    (CODELLAMA, "codellama", "<s>▁<PRE>def f(x):\n    ▁<SUF>\n    return y\n▁<MID>"),
])
def test_families_with_a_bos_and_no_repository_format(specials, family, text):
    vocab = Vocab(specials, bos=0)
    layout, got = written(vocab)
    assert (layout.family, got) == (family, text)
    with pytest.raises(FimUnsupported, match="no repository context"):
        written(vocab, files=FILES)


def test_ids_the_file_declares_win_and_unknown_ones_get_llama_cpps_layout():
    meta = {"tokenizer.ggml.fim_pre_token_id": 1, "tokenizer.ggml.fim_suf_token_id": 2,
            "tokenizer.ggml.fim_mid_token_id": 3, "tokenizer.ggml.fim_sep_token_id": 4,
            "tokenizer.ggml.fim_pad_token_id": 5, "tokenizer.ggml.eos_token_id": 0}
    assert fim_ids(meta) == {"pre": 1, "suf": 2, "mid": 3, "sep": 4, "pad": 5}
    vocab = Vocab(["<eos>", "<PRE>", "<SUF>", "<MID>", "<SEP>", "<PAD>"])
    layout, text = written(vocab, files=FILES[:1], declared=fim_ids(meta))
    assert layout.family == "declared by the model file" and set(layout.end_ids) == {4, 5}
    assert text == ("<SEP>src/util.py\ndef sub(a, b):\n    return a - b\n<SEP>src/main.py\n"
                    "<PRE>def f(x):\n    <SUF>\n    return y\n<MID>")
    # declared ids whose texts are a known family's: that family's own layout
    assert find_layout(Vocab(QWEN), {"pre": 1, "suf": 3, "mid": 2}).family == "qwen2.5-coder"


def test_a_model_without_fim_tokens_is_told_what_is_missing():
    with pytest.raises(FimUnsupported) as err:
        find_layout(Vocab(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]), {})
    assert "tokenizer.ggml.fim_pre_token_id" in str(err.value) and "qwen2.5-coder" in str(err.value)
    # a partial family (no middle token) is no family
    with pytest.raises(FimUnsupported):
        find_layout(Vocab(["<fim_prefix>", "<fim_suffix>"]), {})


def test_the_default_models_real_vocabulary_has_none():
    from scratchllm.tokenizer.tokenizer import Tokenizer

    with pytest.raises(FimUnsupported, match="no fill-in-the-middle tokens"):
        Tokenizer.from_pretrained("default").fim_layout()
