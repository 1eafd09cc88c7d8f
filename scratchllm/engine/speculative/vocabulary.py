"""A draft model must speak the target's vocabulary: the same token ids for the same texts, the
same end token, logits over the same ids. The acceptance rules compare the two models'
probabilities of one token id, so a draft whose id 1234 is another text would have its drafts
verified against the wrong token: refused at start, naming the first difference.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from scratchllm.errors import ConfigError


@runtime_checkable
class Vocabulary(Protocol):
    """What the check reads of a tokenizer (scratchllm.tokenizer.Tokenizer has it)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def id_to_token(self, token_id: int) -> str: ...


def check_same_vocabulary(target: Vocabulary, draft: Vocabulary, target_logits: int, draft_logits: int,
                          draft_name: str = "the draft model") -> None:
    """Raise ConfigError naming the first difference between the target's vocabulary and the
    draft's: the width of their logits, the number of tokens, the end token, a token's text."""
    def refuse(what: str) -> None:
        raise ConfigError(f"{draft_name} cannot draft for this model: its vocabulary differs ({what})")

    if target_logits != draft_logits:
        refuse(f"logits over {draft_logits} token ids, the target's over {target_logits}")
    if target.vocab_size != draft.vocab_size:
        refuse(f"{draft.vocab_size} tokens, the target has {target.vocab_size}")
    if target.eos_token_id != draft.eos_token_id:
        refuse(f"end token {draft.eos_token_id}, the target's is {target.eos_token_id}")
    for i in range(target.vocab_size):
        a, b = target.id_to_token(i), draft.id_to_token(i)
        if a != b:
            refuse(f"token {i} is {b!r} in the draft and {a!r} in the target")
