"""Read a tokenizer from the files a checkpoint ships: GGUF metadata (gguf_vocab.py), tokenizer.json (+ its
tokenizer_config.json), a BERT vocab.txt, or a tiktoken rank file. Each returns a TokenizerSpec.

Only what the files declare is used; anything we do not implement is refused with a FormatError
naming the file and the component, never silently approximated.
"""

import base64
import dataclasses
import json
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import regex

from scratchllm.errors import FormatError
from scratchllm.formats.checkpoint import Checkpoint
from scratchllm.formats.files import is_gguf
from scratchllm.formats.refs import resolve_model
from scratchllm.tokenizer import pretokenize as pt
from scratchllm.tokenizer import spm_json
from scratchllm.tokenizer.bpe import BPE
from scratchllm.tokenizer.bytelevel import BYTE_TO_CHAR
from scratchllm.tokenizer.end_tokens import generation_config_end_ids
from scratchllm.tokenizer.gguf_vocab import from_gguf
from scratchllm.tokenizer.spec import TokenizerSpec
from scratchllm.tokenizer.wordpiece import WordPiece, bert_normalize, bert_pre_tokenize

# A node of a parsed tokenizer.json, unchecked: a wrong shape raises KeyError, TypeError or
# AttributeError, which from_tokenizer_json reports as a malformed file.
Json = Any


def load_spec(ref: str | Path, *, pattern: str = pt.GPT2_PATTERN, special_tokens: dict[str, int] | None = None,
              checkpoint: Checkpoint | None = None) -> TokenizerSpec:
    """pattern and special_tokens apply to tiktoken rank files only, which carry neither.
    checkpoint: the model file already opened (formats.load_checkpoint), so that a GGUF's header
    is parsed once for the model and its tokenizer; ignored unless it is the same file as `ref`."""
    path = resolve_model(ref)
    if path.is_dir():
        if (path / "tokenizer.json").exists():
            return with_generation_config(from_tokenizer_json(path / "tokenizer.json"), path)
        if (path / "vocab.txt").exists():
            return from_vocab_txt(path)
        raise FormatError(path, "no tokenizer here: expected tokenizer.json or vocab.txt")
    if is_gguf(path):
        metadata = None
        if checkpoint is not None and checkpoint.format == "gguf" and Path(checkpoint.path) == path:
            metadata = checkpoint.metadata  # the same file: its header is not parsed again
        return from_gguf(path, metadata)
    if path.name.endswith(".json"):
        return with_generation_config(from_tokenizer_json(path), path.parent)
    return from_tiktoken(path, pattern=pattern, special_tokens=special_tokens)


def with_generation_config(spec: TokenizerSpec, folder: Path) -> TokenizerSpec:
    """A Hugging Face folder's tokenizer with its generation_config.json's end tokens."""
    vocab_size = max(len(spec.id_to_token), max(spec.added.values(), default=-1) + 1)
    ends = generation_config_end_ids(folder, vocab_size)
    return dataclasses.replace(spec, end_token_ids=spec.end_token_ids | ends) if ends else spec


# ---- tiktoken -----------------------------------------------------------------------------
def from_tiktoken(path: str | Path, *, pattern: str = pt.GPT2_PATTERN,
                  special_tokens: dict[str, int] | None = None) -> TokenizerSpec:
    """A rank file: one 'base64(token bytes) rank' per line, rank = id, as tiktoken loads.

    The file carries no pattern and no special tokens: GPT-2's regex is the default, and, as for
    GPT-2, '<|endoftext|>' takes the id after the last rank unless special_tokens says otherwise.
    """
    ranked: dict[str, int] = {}
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise FormatError(path, f"cannot read: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token_b64, rank_text = line.split()
            token = base64.b64decode(token_b64, validate=True)
            rank = int(rank_text)
        except ValueError:
            raise FormatError(path, f"line {n} is not 'base64-token rank' (is this a tiktoken rank file?)") from None
        # Tokens are kept in the byte-level alphabet so the BPE code is shared with GPT-2 vocabularies.
        ranked["".join(BYTE_TO_CHAR[b] for b in token)] = rank
    missing = [b for b in range(256) if BYTE_TO_CHAR[b] not in ranked]
    if missing:
        raise FormatError(path, f"{len(missing)} single bytes have no rank (e.g. {missing[0]}); BPE needs all 256")
    n_ids = max(ranked.values()) + 1
    id_to_token = [""] * n_ids
    for text, rank in ranked.items():
        id_to_token[rank] = text
    if special_tokens is None:
        special_tokens = {"<|endoftext|>": n_ids}
    eot = special_tokens.get("<|endoftext|>")
    return TokenizerSpec(
        kind="bpe", model=BPE.from_ranked_tokens(ranked), id_to_token=id_to_token,
        pre_tokenizer=pt.PreTokenizer([pt.Split(pattern)]),
        added=dict(special_tokens), special_ids=frozenset(special_tokens.values()),
        bos_token_id=eot, eos_token_id=eot, source=str(path),
    )


# ---- tokenizer.json -----------------------------------------------------------------------
def from_tokenizer_json(path: str | Path) -> TokenizerSpec:
    path = Path(path)
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FormatError(path, f"cannot read tokenizer.json: {e}") from None
    try:
        return _from_tokenizer_json(spec, path)
    except FormatError:  # a ValueError too: already says what is wrong
        raise
    except (LookupError, TypeError, AttributeError, ValueError, OverflowError) as e:  # int("vocab"), int(inf)
        raise FormatError(path, f"malformed tokenizer.json ({type(e).__name__}: {e})") from None


def _from_tokenizer_json(spec: Json, path: Path) -> TokenizerSpec:
    config = _read_config(path.parent)
    model_spec = spec.get("model") or {}
    mtype = model_spec.get("type")
    added_tokens = spec.get("added_tokens") or []
    added = {t["content"]: int(t["id"]) for t in added_tokens}
    special = frozenset(int(t["id"]) for t in added_tokens if t.get("special"))
    options = {t["content"]: (bool(t.get("lstrip")), bool(t.get("rstrip")), bool(t.get("single_word")))
               for t in added_tokens if t.get("lstrip") or t.get("rstrip") or t.get("single_word")}
    # Not modelled: `normalized: true` tokens are matched on the raw text here, on normalized text
    # by tokenizers; the two differ only where the normalizer changes the token's own characters.

    model: BPE | WordPiece | spm_json.PieceMergesBPE
    normalizer = _normalizer(spec.get("normalizer"), path)
    pre_tokenizer: Callable[[str], list[str]] | None = None
    prefix_space = "never"
    if mtype == "BPE":
        vocab = _vocab(model_spec["vocab"], added, path)
        merges = [_merge_pair(m, path) for m in model_spec.get("merges", [])]
        if _is_byte_level(spec):
            unk = model_spec.get("unk_token")
            model = BPE.from_merges(vocab, merges, ignore_merges=bool(model_spec.get("ignore_merges", False)),
                                    unk_id=vocab.get(unk) if unk else None)
            kind = "bpe"
        elif spm_json.is_piece_decoder(spec.get("decoder")):  # converted from SentencePiece
            pieces = spm_json.read(spec, path, vocab, merges, normalizer)
            model, normalizer, pre_tokenizer, prefix_space = (pieces.model, pieces.normalizer,
                                                              pieces.pre_tokenizer, pieces.prefix_space)
            kind = "spm"
        else:
            raise FormatError(path, "BPE is read byte-level (a ByteLevel pre-tokenizer or decoder) or as SentencePiece "
                                    "converted it (a decoder of '\u2581' to spaces); this file has neither")
    elif mtype == "WordPiece":
        vocab = _vocab(model_spec["vocab"], added, path)
        unk, prefix = model_spec.get("unk_token", "[UNK]"), model_spec.get("continuing_subword_prefix", "##")
        if unk not in vocab:
            raise FormatError(path, f"WordPiece unk_token {unk!r} is not in the vocab")
        if not isinstance(prefix, str):
            raise FormatError(path, f"WordPiece continuing_subword_prefix {prefix!r} is not a string")
        model = WordPiece(vocab, unk_token=unk, prefix=prefix,
                          max_chars=int(model_spec.get("max_input_chars_per_word", 100)))
        kind = "wordpiece"
    else:
        raise FormatError(path, f"model type {mtype!r} is not supported (BPE and WordPiece are)")
    if pre_tokenizer is None:
        pre_tokenizer = _pre_tokenizer(spec.get("pre_tokenizer"), path)

    id_to_token = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        id_to_token[i] = token
    prefix, suffix = _post_processor(spec.get("post_processor"), added, vocab, path)
    bos, eos, pad = (_config_token_id(config.get(k), added, vocab) for k in ("bos_token", "eos_token", "pad_token"))
    if kind == "wordpiece" and pad is None:
        pad = added.get("[PAD]", vocab.get("[PAD]"))
    return TokenizerSpec(
        kind=kind, model=model, id_to_token=id_to_token,
        pre_tokenizer=pre_tokenizer, normalizer=normalizer, prefix_space=prefix_space,
        added=added, added_options=options, special_ids=special, prefix_ids=prefix, suffix_ids=suffix,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        chat_template=_chat_template(config, path.parent), model_max_length=_max_length(config, path.parent),
        source=str(path),
    )


def _merge_pair(merge: Json, path: Path) -> tuple[str, str]:
    """One entry of the merges list: "left right" (cut at the first space) or ["left", "right"]."""
    pair = merge.split(" ", 1) if isinstance(merge, str) else merge
    if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(half, str) for half in pair):
        raise FormatError(path, f"merge {merge!r:.60} is not two halves")
    return pair[0], pair[1]


def _vocab(entries: Json, added: dict[str, int], path: Path) -> dict[str, int]:
    """The model's vocab, its ids checked: tables are as long as the largest id, so an id past any
    plausible gap (or below 0) is refused (2**63 was an OverflowError, 10**12 a table of 8 TB)."""
    vocab = {str(k): int(v) for k, v in entries.items()}
    limit = 4 * (len(vocab) + len(added)) + 1024
    if bad := [i for i in (*vocab.values(), *added.values()) if not 0 <= i < limit][:1]:
        raise FormatError(path, f"vocab id {bad[0]} is outside 0..{limit - 1} for {len(vocab)} tokens")
    return vocab


def _is_byte_level(spec: Json) -> bool:
    text = json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
    return '"ByteLevel"' in text


def _pre_tokenizer(node: Json, path: Path) -> Callable[[str], list[str]]:
    if node is None:
        return pt.PreTokenizer([])
    kind = node.get("type")
    if kind == "BertPreTokenizer":
        return bert_pre_tokenize
    return pt.PreTokenizer(_split_steps(node, path))


def _split_steps(node: Json, path: Path) -> list[pt.Split]:
    kind = node.get("type")
    if kind == "Sequence":
        return [s for child in node["pretokenizers"] for s in _split_steps(child, path)]
    if kind == "ByteLevel":
        if node.get("add_prefix_space"):
            raise FormatError(path, "ByteLevel add_prefix_space=true is not supported")
        return [pt.Split(pt.GPT2_PATTERN)] if node.get("use_regex", True) else []
    if kind == "Digits":
        return [pt.Split(r"\p{N}" if node.get("individual_digits") else r"\p{N}+")]
    if kind == "Split":
        pattern = node["pattern"]
        source = pattern["Regex"] if "Regex" in pattern else pt.escape(pattern["String"])
        behavior = {"Isolated": "isolated", "Removed": "removed"}.get(node.get("behavior"))
        if behavior is None:
            raise FormatError(path, f"Split behavior {node.get('behavior')!r} is not supported")
        return [pt.Split(source, behavior, bool(node.get("invert", False)))]
    if kind == "Whitespace":
        return [pt.Split(r"\w+|[^\w\s]+", "removed", invert=True)]
    if kind == "WhitespaceSplit":
        return [pt.Split(r"\s+", "removed")]
    raise FormatError(path, f"pre-tokenizer {kind!r} is not supported")


def _normalizer(node: Json, path: Path) -> Callable[[str], str] | None:
    if node is None:
        return None
    kind = node.get("type")
    if kind == "Sequence":
        steps: list[Callable[[str], str]] = []
        for child in node["normalizers"]:
            step = _normalizer(child, path)
            if step is None:
                raise FormatError(path, "a normalizer Sequence has a null step")
            steps.append(step)

        def sequence(text: str) -> str:
            for step in steps:
                text = step(text)
            return text

        return sequence
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return lambda text: unicodedata.normalize(kind, text)
    if kind == "Lowercase":
        return str.lower
    if kind == "Prepend":  # SentencePiece's prefix space, on every non-empty section
        prepend = node["prepend"]
        if not isinstance(prepend, str):
            raise FormatError(path, f"Prepend {prepend!r} is not a string")
        return lambda text: prepend + text if text else text
    if kind == "Replace":
        pattern, content = node["pattern"], node["content"]
        if not isinstance(content, str):
            raise FormatError(path, f"Replace content {content!r} is not a string")
        if "String" in pattern:
            old = pattern["String"]
            if not isinstance(old, str) or not old:
                raise FormatError(path, f"Replace pattern {old!r} is not a non-empty string")
            return lambda text: text.replace(old, content)
        compiled = regex.compile(pattern["Regex"])
        return lambda text: compiled.sub(lambda _: content, text)
    if kind == "BertNormalizer":
        opts = dict(lowercase=bool(node.get("lowercase", True)), strip_accents=node.get("strip_accents"),
                    clean_text=bool(node.get("clean_text", True)),
                    handle_chinese_chars=bool(node.get("handle_chinese_chars", True)))
        return lambda text: bert_normalize(text, **opts)
    raise FormatError(path, f"normalizer {kind!r} is not supported")


def _post_processor(node: Json, added: dict[str, int], vocab: dict[str, int],
                    path: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids encode(add_special_tokens=True) puts before and after a single sequence."""
    if node is None:
        return (), ()
    kind = node.get("type")
    if kind == "Sequence":
        prefix: tuple[int, ...] = ()
        suffix: tuple[int, ...] = ()
        for child in node["processors"]:
            p, s = _post_processor(child, added, vocab, path)
            prefix, suffix = prefix + p, s + suffix
        return prefix, suffix
    if kind == "ByteLevel":
        return (), ()
    if kind in ("BertProcessing", "RobertaProcessing"):
        return (int(node["cls"][1]),), (int(node["sep"][1]),)
    if kind == "TemplateProcessing":
        before: list[int] = []
        after: list[int] = []
        seen_text = False
        for item in node["single"]:
            if "Sequence" in item:
                seen_text = True
                continue
            name = item["SpecialToken"]["id"]
            ids = node["special_tokens"][name]["ids"]
            (after if seen_text else before).extend(int(i) for i in ids)
        return tuple(before), tuple(after)
    raise FormatError(path, f"post-processor {kind!r} is not supported")


# ---- tokenizer_config.json and friends ------------------------------------------------------
def _read_config(folder: Path) -> dict[str, Json]:
    f = folder / "tokenizer_config.json"
    if not f.exists():
        return {}
    try:
        config = json.loads(f.read_text(encoding="utf-8"))
    except ValueError as e:
        raise FormatError(f, f"not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise FormatError(f, f"a JSON {type(config).__name__}, not an object")
    return config


def _config_token_id(value: Json, added: dict[str, int], vocab: dict[str, int]) -> int | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    if not value:
        return None
    return added.get(value, vocab.get(value))


def _chat_template(config: dict[str, Json], folder: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return template


def _max_length(config: dict[str, Json], folder: Path) -> int | None:
    # sentence-transformers truncates at its own max_seq_length, which is what the embeddings
    # were computed with; fall back to the tokenizer's model_max_length.
    st = folder / "sentence_bert_config.json"
    if st.exists():
        try:
            return int(json.loads(st.read_text())["max_seq_length"])
        except (ValueError, KeyError, TypeError):
            pass
    value = config.get("model_max_length")
    return int(value) if isinstance(value, int | float) and value < 1e9 else None


# ---- BERT vocab.txt -------------------------------------------------------------------------
def from_vocab_txt(folder: Path) -> TokenizerSpec:
    """A BERT folder without tokenizer.json: vocab.txt (one token per line, id = line number)."""
    tokens = (folder / "vocab.txt").read_text(encoding="utf-8").splitlines()
    vocab = {t: i for i, t in enumerate(tokens)}
    config = _read_config(folder)
    lowercase = bool(config.get("do_lower_case", True))
    strip = config.get("strip_accents")
    names = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    missing = [n for n in names if n not in vocab]
    if missing:
        raise FormatError(folder / "vocab.txt", f"a BERT vocabulary needs {', '.join(missing)}")
    added = {n: vocab[n] for n in names}
    return TokenizerSpec(
        kind="wordpiece", model=WordPiece(vocab), id_to_token=tokens, pre_tokenizer=bert_pre_tokenize,
        normalizer=lambda text: bert_normalize(text, lowercase=lowercase, strip_accents=strip),
        added=added, special_ids=frozenset(added.values()),
        prefix_ids=(vocab["[CLS]"],), suffix_ids=(vocab["[SEP]"],), pad_token_id=vocab["[PAD]"],
        model_max_length=_max_length(config, folder), source=str(folder),
    )
