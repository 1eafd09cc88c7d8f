"""SmolLM2's byte-level BPE, read from its GGUF, against Hugging Face tokenizers built from the
same vocabulary and merges (conftest.smollm_reference), and against the peers' prompt ids."""

import json

import pytest

from scratchllm import Tokenizer

# The ids llama.cpp and transformers both feed for this prompt.
ANCHOR_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
ANCHOR_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def ours():
    return Tokenizer.from_pretrained("default")


def test_anchor_prompt_ids(ours):
    assert ours.encode(ANCHOR_PROMPT) == ANCHOR_IDS
    assert ours.decode(ANCHOR_IDS) == ANCHOR_PROMPT


def test_metadata(ours, smollm_vocab):
    tokens, types, _ = smollm_vocab
    assert ours.vocab_size == len(tokens)
    assert (ours.bos_token_id, ours.eos_token_id) == (tokens.index("<|im_start|>"), tokens.index("<|im_end|>"))
    # add_bos_token is false in this file: encode adds nothing.
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)
    assert ours.special_ids == {i for i, t in enumerate(types) if t == 3}


def test_ids_equal_tokenizers_on_corpus(ours, smollm_reference, all_docs, same_ids):
    def ref(text):
        return smollm_reference.encode(text, add_special_tokens=False).ids

    assert same_ids(ours.encode, ref, all_docs) > 20_000


def test_round_trip(ours, all_docs):
    for _, text in all_docs:
        assert ours.decode(ours.encode(text)) == text


def test_decode_equals_tokenizers(ours, smollm_reference, docs):
    ids = ours.encode(ANCHOR_PROMPT + docs["emoji"][1]) + ours.encode("你好")[:1]  # ends in a cut character
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == smollm_reference.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids).endswith("\ufffd")


def test_special_tokens_never_split(ours, smollm_vocab):
    tokens, types, _ = smollm_vocab
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind == 3]
    text = "x".join(specials) + "<|im_start|<|im_end|>>"
    ids = ours.encode(text)
    assert [i for i in ids if i in ours.special_ids] == [tokens.index(s) for s in specials] + [2]
    # A special written with a typo is ordinary text.
    assert not set(ours.encode("<|im_star|>")) & ours.special_ids


def test_digits_follow_the_declared_pre_tokenizer(ours, smollm_reference):
    # 'smollm' isolates digits before GPT-2's rule: spaces before a number stay one piece.
    text = "x  12 and  345"
    assert ours.encode(text) == smollm_reference.encode(text).ids
    assert [ours.decode([i]) for i in ours.encode(text)][:4] == ["x", "  ", "1", "2"]


def test_tokenizer_json_folder(tmp_path, ours, smollm_reference, all_docs, same_ids):
    """The same vocabulary saved as tokenizer.json + tokenizer_config.json reads the same."""
    smollm_reference.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": ours.chat_template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    from_json = Tokenizer.from_pretrained(tmp_path)
    assert (from_json.bos_token_id, from_json.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)
    assert from_json.chat_template == ours.chat_template
    docs = [d for d in all_docs if d[0] != "prose"]  # prose is covered above; keep this test quick

    def ref(text):
        return smollm_reference.encode(text, add_special_tokens=False).ids

    same_ids(from_json.encode, ref, docs)
