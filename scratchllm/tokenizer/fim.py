"""Fill-in-the-middle prompts: the text before and after an insertion point, laid out in the
tokens a code model was trained on, so that what it writes next is the middle.

A family is found from the tokenizer: the GGUF keys `tokenizer.ggml.fim_pre_token_id` /
`fim_suf` / `fim_mid` / `fim_pad` / `fim_rep` / `fim_sep` where the file names them (as llama.cpp
reads them), else the token texts of a known family in the vocabulary:

  qwen2.5-coder   <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>; repository context
                  <|repo_name|>{name}\\n<|file_sep|>{path}\\n{text}\\n ... <|file_sep|>{path}\\n
                  before it (the Qwen2.5-Coder report's repo-level format); ends at <|endoftext|>
  starcoder2      <fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>; repository context
                  <repo_name>{name}<file_sep>{path}\\n{text} ... <file_sep><fim_prefix>{path}\\n
                  {prefix}... (the StarCoder2 paper's format); ends at <|endoftext|> or <file_sep>
  codegemma       <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>; other files as
                  {path}\\n{text}<|file_separator|> before it; ends at <|file_separator|>
  deepseek-coder  <BOS><｜fim▁begin｜>{prefix}<｜fim▁hole｜>{suffix}<｜fim▁end｜>; no repository format
  codellama       <BOS>▁<PRE>{prefix}▁<SUF>{suffix}▁<MID> (ids, each text tokenized alone); ends
                  at ▁<EOT>; no repository format
A file whose keys name the tokens, of no known family, is laid out as llama.cpp's server lays
it out: `[rep]{name}\\n` and `[sep]{path}\\n{text}` per file, `[sep]{path}\\n`, then
`[pre]{prefix}[suf]{suffix}[mid]`.

`FimLayout.prompt_ids` tokenizes the text between special tokens as the tokenizer tokenizes any
text (so ids equal transformers' tokenizer run on the layout written out as one string); a
file's text that does not end in a newline gets one before the next separator.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from scratchllm.tokenizer.gguf_meta import FIM_KEYS

ROLES = ("pre", "suf", "mid")  # the three a layout cannot do without


@dataclass(frozen=True)
class FimFamily:
    """A family's token texts by role (a vocabulary with all of them is the family's), its
    repository layout ("repo_tokens", "starcoder2", "codegemma", or None: none) and the texts
    of the tokens that end a middle."""

    name: str
    tokens: Mapping[str, str]
    repo: str | None
    ends: tuple[str, ...]
    bos: bool = False  # the layout starts with the tokenizer's BOS


FAMILIES = (
    FimFamily("qwen2.5-coder", {"pre": "<|fim_prefix|>", "suf": "<|fim_suffix|>", "mid": "<|fim_middle|>",
                                "pad": "<|fim_pad|>", "rep": "<|repo_name|>", "sep": "<|file_sep|>"},
              "repo_tokens", ("<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")),
    # CodeGemma shares Qwen's three texts: its <|file_separator|> tells them apart (checked first)
    FimFamily("codegemma", {"pre": "<|fim_prefix|>", "suf": "<|fim_suffix|>", "mid": "<|fim_middle|>",
                            "sep": "<|file_separator|>"}, "codegemma", ("<|file_separator|>", "<eos>")),
    FimFamily("starcoder2", {"pre": "<fim_prefix>", "suf": "<fim_suffix>", "mid": "<fim_middle>", "pad": "<fim_pad>",
                             "rep": "<repo_name>", "sep": "<file_sep>"},
              "starcoder2", ("<|endoftext|>", "<file_sep>", "<fim_pad>")),
    FimFamily("deepseek-coder", {"pre": "<｜fim▁begin｜>", "suf": "<｜fim▁hole｜>", "mid": "<｜fim▁end｜>"}, None,
              ("<｜end▁of▁sentence｜>", "<|EOT|>"), bos=True),
    FimFamily("codellama", {"pre": "▁<PRE>", "suf": "▁<SUF>", "mid": "▁<MID>", "eot": "▁<EOT>"}, None,
              ("▁<EOT>",), bos=True),
)
CHECK_ORDER = ("codegemma", "qwen2.5-coder", "starcoder2", "deepseek-coder", "codellama")


class FimTokenizer(Protocol):
    """What a layout needs of a tokenizer (tokenizer.Tokenizer has it)."""

    @property
    def bos_token_id(self) -> int | None: ...

    def token_to_id(self, token: str) -> int | None: ...

    def id_to_token(self, token_id: int) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class RepoFile:
    """A file of repository context: its path and text (llama.cpp's input_extra chunk)."""

    path: str
    text: str


Piece = str | int  # text, or a token id


@dataclass(frozen=True)
class FimLayout:
    """One model's fill-in-the-middle layout: its family's name, the ids of its tokens by role,
    the repository layout, and the ids that end a middle."""

    family: str
    ids: Mapping[str, int]
    repo: str | None
    end_ids: tuple[int, ...]
    bos_id: int | None = None

    def pieces(self, prefix: str, suffix: str, files: Sequence[RepoFile] = (), repo_name: str = "",
               path: str = "") -> list[Piece]:
        """The prompt as text and token ids, in order. `files`: repository context (only for a
        layout that has one: FimUnsupported otherwise), `path` the file being edited."""
        t = self.ids
        out: list[Piece] = [self.bos_id] if self.bos_id is not None else []
        if files and self.repo is None:
            raise FimUnsupported(f"{self.family}'s fill-in-the-middle format has no repository context")
        pre: list[Piece] = [t["pre"], prefix]
        if files and self.repo == "repo_tokens":
            if "rep" in t:
                out += [t["rep"], f"{repo_name}\n"]
            for f in files:
                out += [t["sep"], f"{f.path}\n{_ended(f.text)}"]
            out += [t["sep"], f"{path}\n"]
        elif files and self.repo == "starcoder2":
            out += [t["rep"], repo_name]
            for f in files:
                out += [t["sep"], f"{f.path}\n{f.text}"]
            out += [t["sep"]]
            pre = [t["pre"], f"{path}\n{prefix}"]
        elif files and self.repo == "codegemma":
            for f in files:
                out += [f"{f.path}\n{f.text}", t["sep"]]
        return out + pre + [t["suf"], suffix, t["mid"]]

    def prompt_ids(self, tok: FimTokenizer, prefix: str, suffix: str, files: Sequence[RepoFile] = (),
                   repo_name: str = "", path: str = "") -> list[int]:
        """The prompt's token ids: each run of text between tokens tokenized as one text."""
        ids: list[int] = []
        text = ""
        for piece in [*self.pieces(prefix, suffix, files, repo_name, path), 0]:  # 0: a sentinel id
            if isinstance(piece, str):
                text += piece
                continue
            if text:
                ids += tok.encode(text, add_special_tokens=False)
                text = ""
            ids.append(piece)
        return ids[:-1]


class FimUnsupported(ValueError):
    """The model has no fill-in-the-middle tokens, or its format cannot lay out what was asked."""


def _ended(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


def find_layout(tok: FimTokenizer, declared: Mapping[str, int] | None = None) -> FimLayout:
    """The model's layout: from the ids its file declares (`declared`, by role), else from a known
    family's token texts in its vocabulary. FimUnsupported names what is missing."""
    declared = dict(declared or {})
    if all(r in declared for r in ROLES):
        texts = {role: tok.id_to_token(i) for role, i in declared.items()}
        known = next((f for f in _families() if _has(tok, f) and all(texts[r] == f.tokens[r] for r in ROLES)), None)
        if known is None:  # named by the file only: llama.cpp's layout, ended by its EOG tokens
            ends = tuple(declared[r] for r in ("eot", "pad", "rep", "sep") if r in declared)
            return FimLayout("declared by the model file", declared, "repo_tokens" if "sep" in declared else None,
                             ends)
        return _from_family(tok, known, declared)
    for family in _families():
        if _has(tok, family):
            return _from_family(tok, family, {})
    missing = ", ".join(f"tokenizer.ggml.{FIM_KEYS[r][0]}_token_id" for r in ROLES if r not in declared)
    raise FimUnsupported(f"this model has no fill-in-the-middle tokens: its file names none ({missing}) and its "
                         f"vocabulary has no known family's ({', '.join(CHECK_ORDER)})")


def _has(tok: FimTokenizer, family: FimFamily) -> bool:
    """A family is known by all of its token texts."""
    return all(tok.token_to_id(text) is not None for text in family.tokens.values())


def _families() -> list[FimFamily]:
    by_name = {f.name: f for f in FAMILIES}
    return [by_name[n] for n in CHECK_ORDER]


def _from_family(tok: FimTokenizer, family: FimFamily, declared: Mapping[str, int]) -> FimLayout:
    ids = {role: i for role, text in family.tokens.items() if (i := tok.token_to_id(text)) is not None}
    ids.update(declared)
    repo = family.repo if "sep" in ids else None
    ends = tuple(i for text in family.ends if (i := tok.token_to_id(text)) is not None)
    return FimLayout(family.name, ids, repo, ends, tok.bos_token_id if family.bos else None)
