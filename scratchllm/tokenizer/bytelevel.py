"""GPT-2's byte-level alphabet: every byte gets a printable stand-in character.

Byte-level BPE works on bytes, but vocabularies (tokenizer.json, GGUF `tokenizer.ggml.tokens`)
store tokens as text. GPT-2 solved this by giving each of the 256 byte values a visible Unicode
character: printable Latin-1 bytes stand for themselves, the other 68 (controls, space, ...) are
shifted to U+0100 and up, which is why a leading space shows as 'Ġ' (U+0120) and a newline as 'Ċ'.
"""

# Bytes whose Latin-1 character is printable keep it: '!'..'~', '¡'..'¬', '®'..'ÿ'.
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]


def _byte_to_char() -> list[str]:
    table = [""] * 256
    shifted = 0
    for b in range(256):
        if b in _PRINTABLE:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


BYTE_TO_CHAR: list[str] = _byte_to_char()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
# The mapping is a bijection between bytes and 256 distinct characters.
assert len(CHAR_TO_BYTE) == 256

# str.translate tables: Latin-1 text (one char per byte) -> byte-level text, and back.
_TO_UNICODE = {b: c for b, c in enumerate(BYTE_TO_CHAR)}
_TO_LATIN1 = {ord(c): b for c, b in CHAR_TO_BYTE.items()}


def text_to_bytelevel(text: str) -> str:
    """'Hi 你' -> 'HiĠä½ł': UTF-8 bytes of text, each shown as its stand-in character."""
    # Decoding UTF-8 bytes as Latin-1 gives one char per byte; translate then runs in C.
    return text.encode("utf-8").decode("latin-1").translate(_TO_UNICODE)


def bytelevel_to_bytes(token: str) -> bytes:
    """Inverse of text_to_bytelevel for one token: 'Ġthe' -> b' the'.

    Characters outside the alphabet (a special token's text such as '<|im_end|>' is plain ASCII
    and inside it; anything else) are kept as their own UTF-8 bytes.
    """
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return b"".join(bytes([CHAR_TO_BYTE[c]]) if c in CHAR_TO_BYTE else c.encode("utf-8") for c in token)
