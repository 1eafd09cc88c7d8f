"""The tokenizer tests' corpus and references.

The corpus is built from texts every Python install has, plus lines written here.

English prose: the Python reference manual's topics (pydoc_data). Code: standard-library
modules. Chinese with full-width punctuation, emoji, numbers, whitespace runs and a few other
scripts: written below. Each document stays a separate string so a mismatch names its source.
"""

import importlib.util
import pydoc_data.topics
from pathlib import Path

import pytest

CHINESE = [
    "人工智能正在改变我们的生活方式，从语音助手到自动驾驶汽车，无处不在。",
    "他说：“今天天气很好！”我们一起去公园散步吧？",
    "《三体》是刘慈欣创作的长篇科幻小说；它获得了雨果奖（2015年）。",
    "北京、上海、广州和深圳是中国的一线城市……人口都超过一千万。",
    "请注意：模型的输出并不总是正确的——需要人工检查【重要】。",
    "第１章　全角数字１２３和全角字母ＡＢＣ，以及半角123。",
    "机器学习（Machine Learning）是人工智能的一个分支。",
    "「你好」『世界』〈测试〉〔括号〕～！＠＃￥％……＆＊",
]

EMOJI = [
    "Great job! 🎉🎉🎉 Let's celebrate 🥳",
    "Family: 👨‍👩‍👧‍👦, flags: 🇫🇷🇯🇵🇺🇸, skin tones: 👍🏽👋🏿",
    "I ❤️ Python 🐍 and ☕ in the morning ☀️",
    "Weather: 🌧️ → 🌤️ → ☀️; mood: 😀😃😄😁😆😅🤣😂",
    "数学符号 ∑∫∂√∞ ≠ ≈ ≤ ≥ and arrows ←↑→↓",
]

NUMBERS = [
    "The year 2024 had 366 days; pi is 3.14159265358979 and e = 2.71828.",
    "Prices: $1,234.56, €99.99, ¥10000, 50% off, -42, +7, 1e-9, 0x1F, 0b1010.",
    "Phone: +1 (555) 123-4567; date 2026-11-29T23:59:59Z; version v1.2.3-rc.4",
    "    12345 leading spaces before digits, and  7  8   9 between",
    "x=10**9; y = [1, 22, 333, 4444, 55555, 666666]; z=-0.000001",
    "١٢٣ Arabic-Indic digits, ⅫⅣ roman numerals, ½ ¾ fractions, ² superscripts",
]

WHITESPACE = [
    "a   b\t\tc\n\n\nd",
    "   leading and trailing   ",
    "line one\r\nline two\r\n\r\nline four",
    "\tindented\n\t\tdouble\n    spaces\n\n\n\n",
    "word \u00a0nbsp\u3000ideographic space\u2003em space",
    " ",
    "\n",
    "end with space ",
]

OTHER = [
    "I'm sure you're right, but DON'T you think they'll say it's what we'd've done?",
    "Naïve café façade résumé coöperate — Ångström, Straße, ÆØÅ.",
    "Привет, мир! Как дела? Ελληνικά κείμενα. עברית טקסט. مرحبا بالعالم",
    "日本語のテキスト、カタカナとひらがな。한국어 텍스트입니다.",
    "Mixed: hello世界123abc！？",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "C'est l'été. L'homme qu'il a vu.",
]

STDLIB_MODULES = ["textwrap", "json.decoder", "difflib", "heapq", "string", "fnmatch"]


def prose_docs(limit_chars: int = 60_000) -> list[str]:
    """Python reference-manual topics, in a fixed order, up to about limit_chars."""
    docs, total = [], 0
    for name in sorted(pydoc_data.topics.topics):
        text = pydoc_data.topics.topics[name]
        docs.append(text)
        total += len(text)
        if total >= limit_chars:
            break
    return docs


def code_docs(limit_chars: int = 60_000) -> list[str]:
    docs, total = [], 0
    for module in STDLIB_MODULES:
        text = Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8")
        docs.append(text[: max(0, limit_chars - total)])
        total += len(docs[-1])
        if total >= limit_chars:
            break
    return docs


def written_docs() -> list[str]:
    return CHINESE + EMOJI + NUMBERS + WHITESPACE + OTHER + ["\n".join(CHINESE + EMOJI + NUMBERS + OTHER)]


def corpus(limit_chars: int = 60_000) -> dict[str, list[str]]:
    """Category -> documents."""
    return {
        "prose": prose_docs(limit_chars),
        "code": code_docs(limit_chars),
        "chinese": CHINESE,
        "emoji": EMOJI,
        "numbers": NUMBERS,
        "whitespace": WHITESPACE,
        "other": OTHER,
        "mixed": [written_docs()[-1]],
    }


@pytest.fixture(scope="session")
def docs() -> dict[str, list[str]]:
    return corpus()


@pytest.fixture(scope="session")
def all_docs(docs) -> list[tuple[str, str]]:
    """(category, document) pairs, every category."""
    return [(cat, d) for cat, ds in docs.items() for d in ds]


@pytest.fixture(scope="session")
def smollm_vocab(default_gguf):
    """(tokens, token_types, merges) of SmolLM2, read by the gguf package (the reference reader)."""
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(default_gguf)
    field = reader.fields
    tokens = [str(t) for t in field["tokenizer.ggml.tokens"].contents()]
    types = [int(t) for t in field["tokenizer.ggml.token_type"].contents()]
    merges = [str(m) for m in field["tokenizer.ggml.merges"].contents()]
    return tokens, types, merges


@pytest.fixture(scope="session")
def smollm_reference(smollm_vocab):
    """Hugging Face tokenizers built from the GGUF's vocabulary and merges with the pre-tokenizer
    the file declares (tokenizer.ggml.pre = 'smollm': digits alone, then GPT-2's byte-level rule).

    transformers' own GGUF loader would not do: it ignores tokenizer.ggml.pre and applies plain
    GPT-2 pre-tokenization, so it differs from llama.cpp (and from us) where a digit follows
    spaces or letters ('x  12' keeps '  ' whole here; GPT-2's rule gives ' ' and ' 12').
    """
    tk = pytest.importorskip("tokenizers")
    tokens, types, merges = smollm_vocab
    vocab = {t: i for i, t in enumerate(tokens)}
    model = tk.models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
    ref = tk.Tokenizer(model)
    ref.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Digits(individual_digits=True),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    ref.decoder = tk.decoders.ByteLevel()
    ref.add_special_tokens([tk.AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types, strict=True) if kind == 3])
    return ref


def first_difference(ours: list[int], theirs: list[int]) -> str:
    """A readable note on where two id lists part, for assertion messages."""
    n = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    return f"first difference at {n}: ours {ours[max(0, n - 3):n + 5]} vs reference {theirs[max(0, n - 3):n + 5]}"


def assert_same_ids(ours, reference, documents) -> int:
    """ours, reference: text -> ids. Every document must give the same ids; returns the ids
    compared (so a test can check it compared something)."""
    mismatches, compared = [], 0
    for category, text in documents:
        a, b = ours(text), reference(text)
        compared += len(b)
        if a != b:
            mismatches.append(f"[{category}] {text[:60]!r}: {first_difference(a, b)}")
    assert not mismatches, f"{len(mismatches)} documents differ:\n" + "\n".join(mismatches[:10])
    return compared


@pytest.fixture(scope="session")
def same_ids():
    return assert_same_ids
