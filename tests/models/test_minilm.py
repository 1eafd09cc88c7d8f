"""The real all-MiniLM-L6-v2: our embeddings against sentence-transformers' (STYLE 6, level 3)."""

import numpy as np
import pytest

pytest.importorskip("torch")
sentence_transformers = pytest.importorskip("sentence_transformers")

from scratchllm.models import load_model  # noqa: E402
from scratchllm.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

SENTENCES = [
    "The capital of France is Paris.",
    "Paris is the largest city in France.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A monkey is playing drums.",
    "Python's garbage collector frees cycles that reference counting misses.",
    "def add(a, b):\n    return a + b",
    "The quick brown fox jumps over the lazy dog!",
    "Résumé, naïve café: accents are stripped by the uncased vocabulary.",
    "北京是中国的首都。",
    "Emoji 🙂 and symbols like € and ™ are rare in the vocabulary.",
    "Numbers: 3.14159, 2,718 and 1e-9.",
    "   leading and trailing whitespace   ",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles.",
    "a",
    "Memory bandwidth bounds single-stream decoding of small language models on CPUs.",
]


@pytest.fixture(scope="module")
def reference(minilm_dir):
    model = sentence_transformers.SentenceTransformer(str(minilm_dir), device="cpu")
    return model.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=False, batch_size=32)


def test_embeddings_equal_sentence_transformers(reference, minilm_dir):
    model = load_model("minilm")
    tok = Tokenizer.from_pretrained("minilm")
    # one padded batch: padding must not change any row's embedding
    ids, mask = tok.encode_batch(SENTENCES, max_length=256)  # sentence-transformers' max_seq_length
    ours = model.embed(ids, mask)
    assert ours.shape == reference.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cosine = np.sum(ours * reference, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() >= 0.9999, (cosine.min(), SENTENCES[int(cosine.argmin())])
