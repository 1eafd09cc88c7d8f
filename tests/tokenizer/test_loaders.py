"""Reading tokenizers from small files written here (GGUF through the gguf package's writer):
the GGUF switches (add_bos_token, pre-tokenizer kinds, merges that a whole-word lookup skips) and
the clear refusals of what we do not read."""

import json

import pytest

from scratchllm import Tokenizer
from scratchllm.errors import ConfigError, FormatError
from scratchllm.tokenizer.bytelevel import BYTE_TO_CHAR

gguf = pytest.importorskip("gguf")
tk = pytest.importorskip("tokenizers")

# bc < ab < cd: merging 'abcd' stops at a|bc|d, yet 'abcd' is in the vocabulary.
MERGES = ["b c", "a b", "c d", "Ġ a"]
EXTRA = ["bc", "ab", "cd", "Ġa", "abcd"]
SPECIALS = ["<s>", "</s>"]


def _write_gguf(path, *, model="gpt2", pre="gpt2", add_bos=True):
    tokens = SPECIALS + sorted(BYTE_TO_CHAR) + EXTRA
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens


def _reference(tokens, *, ignore_merges, pattern):
    vocab = {t: i for i, t in enumerate(tokens)}
    ref = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[tuple(m.split()) for m in MERGES],
                                     ignore_merges=ignore_merges))
    ref.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Split(tk.Regex(pattern), behavior="isolated"),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    ref.add_special_tokens([tk.AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return ref


TEXTS = ["abcd", "abcdx abcd", " a abcd</s>", "<s>cd bc", "abc 123 xyz"]


@pytest.mark.parametrize("pre, ignore_merges", [("gpt2", False), ("llama-bpe", True), ("qwen2", False)])
def test_tiny_gguf_matches_tokenizers(tmp_path, pre, ignore_merges):
    from scratchllm.tokenizer.pretokenize import GGUF_PRETOKENIZERS

    tokens = _write_gguf(tmp_path / "tiny.gguf", pre=pre)
    ours = Tokenizer.from_pretrained(tmp_path / "tiny.gguf")
    ref = _reference(tokens, ignore_merges=ignore_merges, pattern=GGUF_PRETOKENIZERS[pre][0].pattern)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text).ids, text
    # Llama 3 takes the whole word; GPT-2's rule merges its way to a|bc|d.
    assert (ours.encode("abcd", add_special_tokens=False) == [tokens.index("abcd")]) == ignore_merges


def test_add_bos_token(tmp_path):
    _write_gguf(tmp_path / "bos.gguf", add_bos=True)
    _write_gguf(tmp_path / "nobos.gguf", add_bos=False)
    with_bos = Tokenizer.from_pretrained(tmp_path / "bos.gguf")
    without = Tokenizer.from_pretrained(tmp_path / "nobos.gguf")
    assert with_bos.encode("ab") == [0] + without.encode("ab")
    assert with_bos.encode("ab", add_special_tokens=False) == without.encode("ab")
    assert with_bos.decode(with_bos.encode("ab"), skip_special_tokens=True) == "ab"


@pytest.mark.parametrize("pre, expected", [("llama-bpe", True), ("gpt-2", False), ("smollm", False)])
def test_add_bos_default_follows_llama_cpp(tmp_path, pre, expected):
    _write_gguf(tmp_path / "x.gguf", pre=pre, add_bos=None)
    tok = Tokenizer.from_pretrained(tmp_path / "x.gguf")
    assert (tok.encode("ab")[:1] == [0]) == expected


@pytest.mark.parametrize("kwargs, message", [({"model": "t5"}, "tokenizer.ggml.model"),
                                             ({"pre": "no-such-pre"}, "no-such-pre")])
def test_unsupported_gguf_tokenizers_are_refused(tmp_path, kwargs, message):
    _write_gguf(tmp_path / "x.gguf", **kwargs)
    with pytest.raises(FormatError, match=message):
        Tokenizer.from_pretrained(tmp_path / "x.gguf")


def test_missing_and_empty_paths(tmp_path):
    with pytest.raises(ConfigError, match="no model"):
        Tokenizer.from_pretrained(tmp_path / "absent")
    with pytest.raises(FormatError, match="no tokenizer"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(FormatError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_added_token_options_equal_tokenizers(tmp_path, smollm_vocab):
    """lstrip / rstrip / single_word on added tokens, as a RoBERTa-style <mask> uses them."""
    tokens, _, merges = smollm_vocab
    ref = tk.Tokenizer(tk.models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                     merges=[tuple(m.split(" ", 1)) for m in merges]))
    ref.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    ref.decoder = tk.decoders.ByteLevel()
    ref.add_special_tokens([tk.AddedToken("<mask>", lstrip=True, special=True, normalized=False),
                            tk.AddedToken("<sep>", rstrip=True, special=True, normalized=False),
                            tk.AddedToken("<w>", single_word=True, special=True, normalized=False)])
    ref.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.from_pretrained(tmp_path)
    for text in ["The <mask> sat", "x   <mask>y", "<mask>", "a <sep>  b", "<sep>\n\nz", "a <w> b", "a<w>b", "<w>!"]:
        assert ours.encode(text) == ref.encode(text).ids, text


def test_malformed_tokenizer_json_is_a_format_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    with pytest.raises(FormatError, match="malformed tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "Unigram", "vocab": []}}')
    with pytest.raises(FormatError, match="Unigram"):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("merge", ["ab", ["a", "b", "c"], ["a", 1]])
def test_a_merge_that_is_not_two_halves_is_a_format_error(tmp_path, merge):
    tokenizer_json = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [merge]},
                      "pre_tokenizer": {"type": "ByteLevel"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    with pytest.raises(FormatError, match="not two halves"):
        Tokenizer.from_pretrained(tmp_path)


def test_a_null_normalizer_step_is_refused_at_load(tmp_path):
    tokenizer_json = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
                      "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}, None]},
                      "pre_tokenizer": {"type": "ByteLevel"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    with pytest.raises(FormatError, match="null step"):
        Tokenizer.from_pretrained(tmp_path)


def test_a_tokenizer_config_that_is_no_object_is_a_format_error(tmp_path):
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]))
    (tmp_path / "tokenizer_config.json").write_text("[]")
    with pytest.raises(FormatError, match="tokenizer_config.json: a JSON list, not an object"):
        Tokenizer.from_pretrained(tmp_path)
