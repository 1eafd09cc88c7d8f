"""Request bodies that are wrong in every way we know of, as raw bytes: each must end as a 4xx
OpenAI error, never another exception. Entries: (name, endpoint, body bytes); endpoint is
"completions" or "chat"."""

BASE_CHAT = '{"model": "m", "messages": [{"role": "user", "content": "hi"}]%s}'
BASE_CMPL = '{"model": "m", "prompt": "hi"%s}'


def chat(extra: str) -> bytes:
    return (BASE_CHAT % extra).encode("utf-8", "surrogatepass")


def cmpl(extra: str) -> bytes:
    return (BASE_CMPL % extra).encode("utf-8", "surrogatepass")


def msgs(messages: str, extra: str = "") -> bytes:
    return ('{"model": "m", "messages": ' + messages + extra + "}").encode("utf-8")


TOOL = '{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}'

CORPUS: list[tuple[str, str, bytes]] = [
    # --- not UTF-8 -------------------------------------------------------------------------------
    ("bare invalid bytes", "chat", b"\xff\xfe\xfd"),
    ("invalid byte in a string", "completions", b'{"model": "m", "prompt": "\xc3\x28"}'),
    ("overlong encoding of /", "completions", b'{"model": "m", "prompt": "\xc0\xaf"}'),
    ("truncated multibyte", "chat", b'{"model": "m", "messages": [{"role": "user", "content": "\xe2\x82"}]}'),
    ("utf-8 encoded surrogate", "completions", b'{"model": "m", "prompt": "\xed\xa0\x80"}'),
    ("utf-16 body", "chat", BASE_CHAT.replace("%s", "").encode("utf-16")),
    ("nul byte", "chat", b"\x00"),
    ("byte order mark", "chat", b"\xef\xbb\xbf" + BASE_CHAT.replace("%s", "").encode()),
    # --- unpaired surrogate escapes (json.loads accepts them) ---------------------------------------
    ("lone high surrogate in prompt", "completions", b'{"model": "m", "prompt": "\\ud800"}'),
    ("lone low surrogate in prompt", "completions", b'{"model": "m", "prompt": "a\\udfffb"}'),
    ("reversed surrogate pair", "completions", b'{"model": "m", "prompt": "\\udc00\\ud800"}'),
    ("surrogate in message content", "chat",
     b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d"}]}'),
    ("surrogate in a key", "chat", chat(', "\\ud800": 1')),
    ("surrogate in stop", "chat", chat(', "stop": ["\\udbff"]')),
    ("surrogate in model", "chat", b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}'),
    ("surrogate in a tool schema", "chat",
     chat(', "tools": [{"type": "function", "function": {"name": "f", "parameters": {"\\ud800": 1}}}]')),
    # --- nesting ---------------------------------------------------------------------------------
    ("10^5 open brackets", "chat", b"[" * 100_000),
    ("10^5 nested arrays", "chat", b"[" * 100_000 + b"]" * 100_000),
    ("10^5 nested objects", "chat", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
    ("deep prompt", "completions", cmpl(', "x": ' + "[" * 5000 + "]" * 5000)),
    ("deep schema", "chat", chat(', "response_format": {"type": "json_schema", "json_schema": {"name": "n", '
                                 '"schema": ' + '{"items":' * 200 + "{}" + "}" * 200 + "}}")),
    ("deep, just past the limit", "chat", chat(', "metadata": ' + "[" * 70 + "]" * 70)),
    # --- numbers ---------------------------------------------------------------------------------
    ("1e400 temperature", "chat", chat(', "temperature": 1e400')),
    ("-1e400 top_p", "chat", chat(', "top_p": -1e400')),
    ("10**400 max_tokens", "completions", cmpl(', "max_tokens": 1' + "0" * 400)),
    ("10**5000 seed", "completions", cmpl(', "seed": 1' + "0" * 5000)),
    ("10**20 n", "chat", chat(', "n": 100000000000000000000')),
    ("2**64 seed", "chat", chat(', "seed": 18446744073709551616')),
    ("NaN", "chat", chat(', "temperature": NaN')),
    ("Infinity", "chat", chat(', "frequency_penalty": Infinity')),
    ("-Infinity", "chat", chat(', "presence_penalty": -Infinity')),
    ("float max_tokens", "completions", cmpl(', "max_tokens": 1.5')),
    ("exponent max_tokens", "completions", cmpl(', "max_tokens": 1e3')),
    ("huge logprobs", "completions", cmpl(', "logprobs": 10000000000000000000')),
    ("negative max_tokens? no: negative top_k", "chat", chat(', "top_k": -5')),
    ("temperature above 2", "chat", chat(', "temperature": 2.5')),
    ("penalty above 2", "completions", cmpl(', "presence_penalty": 3')),
    ("repetition_penalty 0", "chat", chat(', "repetition_penalty": 0')),
    ("min_p above 1", "chat", chat(', "min_p": 1.5')),
    # --- wrong types ------------------------------------------------------------------------------
    ("body is an array", "chat", b"[]"),
    ("body is a string", "chat", b'"hello"'),
    ("body is null", "chat", b"null"),
    ("body is a number", "completions", b"1"),
    ("empty body", "chat", b""),
    ("whitespace body", "chat", b"   "),
    ("truncated json", "chat", BASE_CHAT.replace("%s", "").encode()[:-3]),
    ("trailing garbage", "chat", BASE_CHAT.replace("%s", "").encode() + b"x"),
    ("prompt is a number", "completions", b'{"model": "m", "prompt": 5}'),
    ("prompt is an object", "completions", b'{"model": "m", "prompt": {}}'),
    ("prompt mixes ids and text", "completions", b'{"model": "m", "prompt": [1, "a"]}'),
    ("prompt nested mixed", "completions", b'{"model": "m", "prompt": [[1], ["a"]]}'),
    ("prompt is true", "completions", b'{"model": "m", "prompt": true}'),
    ("model is a number", "chat", b'{"model": 3, "messages": [{"role": "user", "content": "x"}]}'),
    ("messages is a string", "chat", b'{"model": "m", "messages": "hi"}'),
    ("messages is empty", "chat", b'{"model": "m", "messages": []}'),
    ("message is a number", "chat", b'{"model": "m", "messages": [1]}'),
    ("unknown role", "chat", msgs('[{"role": "wizard", "content": "x"}]')),
    ("role is a number", "chat", msgs('[{"role": 1, "content": "x"}]')),
    ("content is a number", "chat", msgs('[{"role": "user", "content": 5}]')),
    ("image part", "chat", msgs('[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]')),
    ("audio part", "chat", msgs('[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]')),
    ("text part without text", "chat", msgs('[{"role": "user", "content": [{"type": "text"}]}]')),
    ("stream is a string", "chat", chat(', "stream": "true"')),
    ("n is a string", "chat", chat(', "n": "2"')),
    ("stop is a number", "chat", chat(', "stop": 5')),
    ("stop holds a number", "chat", chat(', "stop": [1]')),
    ("stop_token_ids holds text", "chat", chat(', "stop_token_ids": ["a"]')),
    ("logit_bias is a list", "chat", chat(', "logit_bias": [1, 2]')),
    ("logit_bias value is text", "chat", chat(', "logit_bias": {"1": "x"}')),
    ("stream_options is a string", "chat", chat(', "stream_options": "x"')),
    ("logprobs is a number in chat", "chat", chat(', "logprobs": 5')),
    ("top_logprobs above 20", "chat", chat(', "logprobs": true, "top_logprobs": 50')),
    ("top_logprobs without logprobs", "chat", chat(', "top_logprobs": 3')),
    ("tools is a string", "chat", chat(', "tools": "x"')),
    ("custom tool", "chat", chat(', "tools": [{"type": "custom", "custom": {"name": "x"}}]')),
    ("tool without a name", "chat", chat(', "tools": [{"type": "function", "function": {}}]')),
    ("tool name with spaces", "chat", chat(', "tools": [{"type": "function", "function": {"name": "a b"}}]')),
    ("two tools of one name", "chat", chat(f', "tools": [{TOOL}, {TOOL}]')),
    ("tool_choice unknown word", "chat", chat(f', "tools": [{TOOL}], "tool_choice": "maybe"')),
    ("tool_choice names a missing tool", "chat",
     chat(f', "tools": [{TOOL}], "tool_choice": {{"type": "function", "function": {{"name": "g"}}}}')),
    ("tool_choice without tools", "chat", chat(', "tool_choice": "required"')),
    ("response_format unknown type", "chat", chat(', "response_format": {"type": "xml"}')),
    ("json_schema without json_schema", "chat", chat(', "response_format": {"type": "json_schema"}')),
    ("json_schema without a name", "chat",
     chat(', "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}')),
    ("two constraints", "chat", chat(', "response_format": {"type": "json_object"}, "guided_regex": "a+"')),
    ("guided_choice of numbers", "completions", cmpl(', "guided_choice": [1, 2]')),
    ("guided_json not json", "completions", cmpl(', "guided_json": "{nope"')),
    # --- missing required fields ---------------------------------------------------------------------
    ("empty object", "chat", b"{}"),
    ("no prompt", "completions", b'{"model": "m"}'),
    ("no model", "completions", b'{"prompt": "x"}'),
    ("no messages", "chat", b'{"model": "m"}'),
    ("message without role", "chat", msgs('[{"content": "x"}]')),
    ("user message without content", "chat", msgs('[{"role": "user"}]')),
    ("system message content null", "chat", msgs('[{"role": "system", "content": null}]')),
    ("tool message without tool_call_id", "chat", msgs('[{"role": "tool", "content": "42"}]')),
    ("tool message without content", "chat", msgs('[{"role": "tool", "tool_call_id": "c1"}]')),
    ("assistant with nothing", "chat", msgs('[{"role": "assistant"}]')),
    ("assistant content null, no calls", "chat", msgs('[{"role": "assistant", "content": null}]')),
    ("tool call without id", "chat",
     msgs('[{"role": "assistant", "tool_calls": [{"type": "function", '
          '"function": {"name": "f", "arguments": "{}"}}]}]')),
    ("tool call arguments as object", "chat",
     msgs('[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", '
          '"function": {"name": "f", "arguments": {}}}]}]')),
    ("function message without name", "chat", msgs('[{"role": "function", "content": "x"}]')),
    # --- refused unless neutral ------------------------------------------------------------------------
    ("n = 0", "chat", chat(', "n": 0')),
    ("n past the most choices", "chat", chat(', "n": 17')),
    ("best_of below n", "completions", cmpl(', "n": 3, "best_of": 2')),
    ("best_of streamed", "completions", cmpl(', "best_of": 2, "stream": true')),
    ("suffix with echo", "completions", cmpl(', "suffix": "tail", "echo": true')),
    ("max_tokens 0 without echo", "completions", cmpl(', "max_tokens": 0')),
    ("audio output", "chat", chat(', "audio": {"voice": "alloy", "format": "mp3"}')),
    ("audio modality", "chat", chat(', "modalities": ["text", "audio"]')),
    ("store", "chat", chat(', "store": true')),
    ("functions", "chat", chat(', "functions": [{"name": "f"}]')),
    ("function_call by name", "chat", chat(', "function_call": {"name": "f"}')),
    ("reasoning_effort", "chat", chat(', "reasoning_effort": "high"')),
    ("verbosity", "chat", chat(', "verbosity": "low"')),
    ("web search", "chat", chat(', "web_search_options": {}')),
    ("logit_bias key not an id", "chat", chat(', "logit_bias": {"abc": 1}')),
    ("logit_bias key negative", "chat", chat(', "logit_bias": {"-1": 1}')),
    ("logit_bias value out of range", "chat", chat(', "logit_bias": {"1": 1000}')),
    ("five stop strings", "chat", chat(', "stop": ["a", "b", "c", "d", "e"]')),
    ("empty stop string", "completions", cmpl(', "stop": [""]')),
]
