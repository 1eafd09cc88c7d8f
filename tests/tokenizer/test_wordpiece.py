"""all-MiniLM-L6-v2's WordPiece (BERT uncased) against Hugging Face tokenizers reading the same
tokenizer.json, which is what sentence-transformers runs."""

import shutil

import numpy as np
import pytest

from scratchllm import Tokenizer

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def ours():
    return Tokenizer.from_pretrained("minilm")


@pytest.fixture(scope="module")
def reference(minilm_dir):
    ref = tokenizers.Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    # The file pads and truncates to 128; compare whole texts, unpadded.
    ref.no_padding()
    ref.no_truncation()
    return ref


def test_ids_equal_tokenizers_on_corpus(ours, reference, all_docs, same_ids):
    def ref(text):
        return reference.encode(text).ids

    assert same_ids(ours.encode, ref, all_docs) > 20_000


def test_cls_sep_and_no_specials(ours, reference):
    ids = ours.encode("Hello, World!")
    assert ids[0] == reference.token_to_id("[CLS]") and ids[-1] == reference.token_to_id("[SEP]")
    assert ours.encode("Hello, World!", add_special_tokens=False) == ids[1:-1]


def test_bert_normalization_cases(ours, reference):
    # accents stripped, CJK spaced out, control characters dropped, punctuation split, unknowns
    for text in ["Café NAÏVE Ångström", "中文字符，全角！", "tab\there\x00\x07zero\u200bwidth", "a+b=c^d$e",
                 "x" * 150, "supercalifragilisticexpialidocious", "[MASK] is [UNK] [CLS]", "🙂 ok",
                 "soft\xadhyphen \ufffd \ue000 private \x1cfile\x1fsep \u3000ideo\u2028line",
                 "हिन्दी भाषा", "e\u0301 combining", "Ⅻ ½ ² ①", "a\x85b\x0bc\x0cd", "\u00a0nbsp\u202fnarrow"]:
        assert ours.encode(text) == reference.encode(text).ids, text


def test_decode_equals_tokenizers(ours, reference, all_docs):
    for _, text in all_docs[-12:]:
        ids = reference.encode(text).ids
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_vocab_txt_folder_reads_the_same(tmp_path, minilm_dir, reference, all_docs, same_ids):
    for name in ("vocab.txt", "tokenizer_config.json"):
        shutil.copy(minilm_dir / name, tmp_path / name)
    plain = Tokenizer.from_pretrained(tmp_path)
    docs = [d for d in all_docs if d[0] != "prose"]
    same_ids(plain.encode, lambda text: reference.encode(text).ids, docs)


def test_encode_batch_pads_and_truncates_like_tokenizers(ours, minilm_dir):
    texts = ["short", "a somewhat longer sentence, with punctuation!", "中文 " * 40, ""]
    ref = tokenizers.Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    ref.enable_truncation(max_length=32)
    ref.enable_padding(pad_id=0, pad_token="[PAD]")
    expected = ref.encode_batch(texts)
    input_ids, attention_mask = ours.encode_batch(texts, max_length=32)
    assert input_ids.shape == (4, 32) and input_ids.dtype == np.int64
    np.testing.assert_array_equal(input_ids, [e.ids for e in expected])
    np.testing.assert_array_equal(attention_mask, [e.attention_mask for e in expected])
    # sentence-transformers truncates at max_seq_length (sentence_bert_config.json)
    assert ours.model_max_length == 256
