"""Our models and tokenizers satisfy the protocols the engine and the server are typed against
(scratchllm/models/protocol.py, scratchllm/tokenizer/protocol.py): checked by mypy, which covers
this file (pyproject.toml [tool.mypy] files), never run. It lives here, above every layer, because
the protocols' own modules may not import the classes of the layers that implement them."""

from scratchllm.engine.fake import FakeTokenizer
from scratchllm.models.bert import BertModel
from scratchllm.models.gpt2 import GPT2Model
from scratchllm.models.llama import LlamaModel
from scratchllm.models.protocol import Embed, Encoder, Model
from scratchllm.tokenizer.protocol import TokenizerLike
from scratchllm.tokenizer.tokenizer import Tokenizer


def llama_is_a_model(m: LlamaModel) -> Model:
    return m


def gpt2_is_a_model(m: GPT2Model) -> Model:
    return m


def bert_is_an_encoder(m: BertModel) -> Encoder:
    return m


def bert_embed_is_an_embed(m: BertModel) -> Embed:
    return m.embed


def ours_is_a_tokenizer(t: Tokenizer) -> TokenizerLike:
    return t


def fake_is_a_tokenizer(t: FakeTokenizer) -> TokenizerLike:
    return t
