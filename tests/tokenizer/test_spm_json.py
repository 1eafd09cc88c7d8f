"""SentencePiece vocabularies that are not Gemma's: a Hugging Face folder's tokenizer.json in the
shapes SentencePiece conversions take (Llama 2 / Mistral, newer Llama conversions, Gemma), and a
llama-kind GGUF vocabulary with add_space_prefix (Llama 2, Mistral; Phi-3's prefix rule).

The vocabulary and merges are learned here by the `tokenizers` library's BPE trainer on the
shared corpus, with an alphabet cut short, so that rare characters (CJK, emoji) fall back to byte
pieces. References nobody here wrote: `tokenizers` itself on each tokenizer.json, and
transformers' tokenizer built from each GGUF file (AutoTokenizer, gguf_file=). Ids with and
without BOS and decoded text (special tokens kept and skipped) must equal theirs on prose, code,
CJK, emoji and whitespace runs, and mixes of fragments of all of them.
"""

import json

import pytest

tk = pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")

from scratchllm.errors import FormatError  # noqa: E402
from scratchllm.tokenizer import Tokenizer  # noqa: E402
from tests.tokenizer.test_sentencepiece import real_texts  # noqa: E402

S = "\u2581"
SPECIALS = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
ADDED_SPECIAL, ADDED_PLAIN = "<|im_start|>", "<think>"  # matched whole in raw text; only the first is special


@pytest.fixture(scope="module")
def learned(docs):
    """(vocab, merges) of a BPE learned by tokenizers' trainer, SentencePiece style: specials,
    the 256 byte pieces, then the learned tokens (single characters first, then merge products in
    merge order), with "▁" for spaces and a "▁" before each word."""
    trainer_tok = tk.Tokenizer(tk.models.BPE())
    trainer_tok.normalizer = tk.normalizers.Replace(" ", S)
    trainer_tok.pre_tokenizer = tk.pre_tokenizers.Metaspace(replacement=S, prepend_scheme="always", split=True)
    trainer = tk.trainers.BpeTrainer(vocab_size=1500, limit_alphabet=120, show_progress=False)
    trainer_tok.train_from_iterator([d for group in docs.values() for d in group], trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    learned_tokens = sorted(model["vocab"], key=model["vocab"].get)
    tokens = SPECIALS + BYTES + [t for t in learned_tokens if t not in BYTES]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return {t: i for i, t in enumerate(tokens)}, merges


def _decoder(strip):
    steps = [tk.decoders.Replace(S, " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()]
    return tk.decoders.Sequence(steps + ([tk.decoders.Strip(" ", 1, 0)] if strip else []))


STYLES = {  # name: (normalizer, pre-tokenizer, decoder strips the prefix space)
    # Llama 2's and Mistral's tokenizer.json: the prefix space as a normalizer, before every section
    "llama2": (lambda: tk.normalizers.Sequence([tk.normalizers.Prepend(S), tk.normalizers.Replace(" ", S)]),
               lambda: None, True),
    # newer Llama conversions (transformers' LlamaTokenizer): Metaspace, a prefix on the first section
    "metaspace-first": (lambda: None, lambda: tk.pre_tokenizers.Metaspace(S, prepend_scheme="first", split=False),
                        True),
    # older conversions: a prefix on every section, words split before each "▁"
    "metaspace-always-split": (lambda: None,
                               lambda: tk.pre_tokenizers.Metaspace(S, prepend_scheme="always", split=True), True),
    # Gemma's: no prefix space
    "gemma": (lambda: tk.normalizers.Replace(" ", S),
              lambda: tk.pre_tokenizers.Split(" ", behavior="merged_with_previous"), False),
}


@pytest.fixture(scope="module")
def folders(learned, tmp_path_factory):
    """style -> a folder holding that style's tokenizer.json."""
    vocab, merges = learned
    out = {}
    for style, (normalizer, pre_tokenizer, strip) in STYLES.items():
        ref = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                         fuse_unk=True))
        ref.normalizer, ref.pre_tokenizer, ref.decoder = normalizer(), pre_tokenizer(), _decoder(strip)
        ref.add_special_tokens([tk.AddedToken(t, special=True, normalized=False) for t in SPECIALS + [ADDED_SPECIAL]])
        ref.add_tokens([tk.AddedToken(ADDED_PLAIN, special=False, normalized=False)])
        ref.post_processor = tk.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        folder = tmp_path_factory.mktemp(style)
        ref.save(str(folder / "tokenizer.json"))
        out[style] = folder
    return out


def texts(docs):
    """Every other one of the shared texts (2000-character cuts of the corpus, then mixes of
    fragments), and added tokens written into some, leading and doubled spaces in others."""
    base = real_texts(docs, 150)[::2]
    extra = [f"{ADDED_SPECIAL}user\nhi {ADDED_PLAIN} there", f" {ADDED_SPECIAL} x", f"a{ADDED_PLAIN}b",
             "  two leading", " one", "<s>bos in text</s>", "\u00e9t\u00e9 日本語 🤗", "x" * 300]
    return base + extra


def assert_matches(ours, encode, decode, items):
    for text in items:
        for special in (True, False):
            ids = encode(text, special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text[:80], special)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == decode(ids, skip), (text[:80], skip)
        d = ours.detokenizer()
        assert "".join(map(d.push, ids)) + d.flush() == ours.decode(ids)


@pytest.mark.parametrize("style", STYLES)
def test_tokenizer_json_ids_and_text_equal_tokenizers(style, folders, docs):
    ours = Tokenizer.from_pretrained(folders[style])
    ref = tk.Tokenizer.from_file(str(folders[style] / "tokenizer.json"))
    assert ours.spec.kind == "spm"
    assert_matches(ours, lambda t, s: ref.encode(t, add_special_tokens=s).ids,
                   lambda ids, skip: ref.decode(ids, skip_special_tokens=skip), texts(docs))


def test_byte_fallback_and_prefix_are_exercised(folders):
    """The corpus reaches byte pieces, and the styles differ where the prefix space does."""
    llama2, first = (Tokenizer.from_pretrained(folders[s]) for s in ("llama2", "metaspace-first"))
    ids = llama2.encode("日本🤗", add_special_tokens=False)
    assert any(llama2.id_to_token(i).startswith("<0x") for i in ids)
    text = f" x{ADDED_SPECIAL}y"
    assert llama2.encode(text) != first.encode(text)  # "▁▁x" and "▁y" against "▁x" and "y"


# ---- GGUF --------------------------------------------------------------------------------------
def write_llama_gguf(path, vocab, arch, add_space_prefix=True):
    """The learned vocabulary as llama.cpp stores a SentencePiece one: pieces, a score per piece
    (the earlier learned, the higher: SentencePiece BPE's scores are its merge order), types."""
    tokens = list(vocab)
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259) + [3, 4]
    tokens += [ADDED_SPECIAL, ADDED_PLAIN]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)])
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_llama_kind_gguf_ids_and_text_equal_transformers(arch, learned, docs, tmp_path):
    from transformers import AutoTokenizer

    path = write_llama_gguf(tmp_path / f"{arch}.gguf", learned[0], arch)
    ours = Tokenizer.from_pretrained(path)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert_matches(ours, lambda t, s: ref.encode(t, add_special_tokens=s),
                   lambda ids, skip: ref.decode(ids, skip_special_tokens=skip), texts(docs))


def test_gguf_without_space_prefix_puts_none(learned, tmp_path):
    ours = Tokenizer.from_pretrained(write_llama_gguf(tmp_path / "x.gguf", learned[0], "llama", False))
    assert ours.id_to_token(ours.encode("the", add_special_tokens=False)[0]) == "the"
    assert ours.decode(ours.encode(" the"), skip_special_tokens=True) == " the"


def test_unigram_and_odd_decoders_are_refused(folders, tmp_path):
    spec = json.loads((folders["llama2"] / "tokenizer.json").read_text())
    for change, message in [
        ({"model": {"type": "Unigram", "vocab": [["a", 0.0]]}}, "'Unigram' is not supported"),
        ({"decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": S}, "content": " "},
                                                       {"type": "Fuse"}]}}, "no ByteFallback"),
        ({"decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": S}, "content": " "},
                                                       {"type": "ByteFallback"}, {"type": "CTC"}]}},
         "decoder 'CTC'"),
        ({"pre_tokenizer": {"type": "Punctuation"}}, "pre-tokenizer 'Punctuation'"),
    ]:
        (tmp_path / "tokenizer.json").write_text(json.dumps(spec | change))
        with pytest.raises(FormatError, match=message):
            Tokenizer.from_pretrained(tmp_path)
