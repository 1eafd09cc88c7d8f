"""The tokens that end generation (tokenizer/end_tokens.py), read from tiny vocabularies: a GGUF's
eos, eot and eom ids and its control tokens spelled as end tokens (byte-level BPE and
SentencePiece), and a Hugging Face folder's generation_config.json (an int or a list)."""

import json
import logging

import pytest

from scratchllm.errors import FormatError
from scratchllm.tokenizer import Tokenizer
from scratchllm.tokenizer.gguf_vocab import from_gguf

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def bpe_gguf(types, **ids):
    """The metadata of a tiny byte-level BPE GGUF: a, b, ab, then named tokens of the given types."""
    tokens = ["a", "b", "ab", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|im_start|>", "<x>"]
    assert len(types) == len(tokens) - 3
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [NORMAL] * 3 + list(types), "tokenizer.ggml.merges": ["a b"],
            "general.architecture": "llama"}
    meta.update({f"tokenizer.ggml.{k}": v for k, v in ids.items()})
    return meta


def test_gguf_control_tokens_spelled_as_end_tokens_end_generation():
    meta = bpe_gguf([CONTROL] * 6, eos_token_id=4)
    tok = Tokenizer(from_gguf("tiny.gguf", meta))
    # <|endoftext|>, <|im_end|> (the EOS), <|eot_id|>, <|eom_id|>; not <|im_start|> nor <x>
    assert tok.eos_token_id == 4 and tok.end_token_ids == {3, 4, 5, 6}


def test_an_ordinary_token_spelled_as_an_end_token_is_text():
    """A token the file types as normal is text the model writes, not an end (only its EOS key is)."""
    meta = bpe_gguf([NORMAL, USER_DEFINED, NORMAL, CONTROL, CONTROL, CONTROL], eos_token_id=7)
    assert Tokenizer(from_gguf("tiny.gguf", meta)).end_token_ids == {4, 6, 7}


def test_gguf_eot_and_eom_ids_end_generation_whatever_their_text(caplog):
    meta = bpe_gguf([NORMAL] * 6, eos_token_id=2, eot_token_id=8, eom_token_id=7, fim_sep_token_id=1)
    assert Tokenizer(from_gguf("tiny.gguf", meta)).end_token_ids == {1, 2, 7, 8}
    with caplog.at_level(logging.WARNING):  # an id outside the vocabulary ends nothing (as llama.cpp)
        out = Tokenizer(from_gguf("tiny.gguf", bpe_gguf([NORMAL] * 6, eos_token_id=2, eot_token_id=99)))
    assert out.end_token_ids == {2} and "eot_token_id 99" in caplog.text


def test_a_sentencepiece_gguf_ends_at_end_of_turn():
    """Gemma's kind of vocabulary: <eos> and the control token <end_of_turn>."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "▁a", "b", "<end_of_turn>", "<start_of_turn>"]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [CONTROL, CONTROL, CONTROL, 2, NORMAL, NORMAL, CONTROL, CONTROL],
            "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.bos_token_id": 2, "general.architecture": "llama"}
    assert Tokenizer(from_gguf("tiny.gguf", meta)).end_token_ids == {1, 6}


def hf_folder(tmp_path, generation_config=None):
    tokenizer_json = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
                      "pre_tokenizer": {"type": "ByteLevel"},
                      "added_tokens": [{"id": 3, "content": "<|endoftext|>", "special": True},
                                       {"id": 4, "content": "<|im_end|>", "special": True},
                                       {"id": 5, "content": "<|im_start|>", "special": True}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


@pytest.mark.parametrize("config,ends", [(None, {4}), ({"eos_token_id": 3}, {3, 4}),
                                         ({"eos_token_id": [4, 3]}, {3, 4}), ({"max_length": 9}, {4})])
def test_generation_config_eos_ids_end_generation(tmp_path, config, ends):
    tok = Tokenizer.from_pretrained(hf_folder(tmp_path, config))
    assert tok.eos_token_id == 4 and tok.end_token_ids == ends
    assert Tokenizer.from_pretrained(tmp_path / "tokenizer.json").end_token_ids == ends  # the file, read alike


@pytest.mark.parametrize("config", [{"eos_token_id": 6}, {"eos_token_id": [3, "4"]}, {"eos_token_id": True}])
def test_a_generation_config_id_outside_the_vocabulary_is_a_format_error(tmp_path, config):
    with pytest.raises(FormatError, match="generation_config.json.*eos_token_id"):
        Tokenizer.from_pretrained(hf_folder(tmp_path, config))
