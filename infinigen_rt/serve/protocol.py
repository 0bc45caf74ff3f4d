"""The OpenAI wire format: request models (strict pydantic), errors, and the response and chunk bodies."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from infinigen_rt.errors import InfinigenError
from infinigen_rt.policies.options import OPTS, TYPES
from infinigen_rt.runner import MAX_LOGPROBS, Logprob, check_stops
from infinigen_rt.sampling import SEED_RANGE
from infinigen_rt.tokenizer import check_text

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS = 512  # OpenAI's chat default is "whatever fits"; on a CPU that is too long to wait for
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_CHOICES = 64  # prompts x n
SCORING = ("decode", "prefill")  # how a prompt's logprobs are computed (serve --score)
SCORE_TAIL = 128  # prompt tokens scored by decode steps by default (serve --score-tail)
MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM's floor)


class APIError(Exception):
    """An error the client caused (or a busy server): sent as {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _kv_fields() -> dict[str, tuple]:
    """The fields of the KV options a request may override, as policies/options.py declares them (those marked
    request): each optional (None leaves the server's), with the declared range or choices."""
    out = {}
    for name, o in OPTS.items():
        if o.request:
            hint = Literal[o.choices] if o.choices is not None else TYPES[name]
            out[name] = (hint | None, Field(None, **o.bounds()))
    return out


KV_REQUEST = tuple(name for name, o in OPTS.items() if o.request)  # the KV options a request may override
_KVFields = create_model("_KVFields", __config__=ConfigDict(extra="forbid", strict=True), **_kv_fields())


class KVOverrides(_KVFields):
    """The per-request `infinigen` object: KV options for this request's batch."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # first the KV options (_KVFields: alpha, budget, spec_keys, correct; the request's sequences build their own
    # speculation keys); then
    # how the prompt's logprobs (echo with logprobs) are scored; not KV options (serve --score, --score-tail)
    score: Literal[SCORING] | None = None
    score_tail: int | None = Field(None, ge=1)

    def changes(self) -> dict[str, Any]:
        """The KV options this request overrides."""
        return {n: v for n in KV_REQUEST if (v := getattr(self, n)) is not None}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


# fields that would change what comes back, and the values that leave it unchanged
UNSUPPORTED = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class BaseRequest(BaseModel):
    # strict: "0.5" is not a number and "yes" is not a boolean; unknown fields (user, metadata) are ignored
    model_config = ConfigDict(extra="ignore", strict=True)
    unsupported: ClassVar[dict] = UNSUPPORTED
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)  # choices per prompt, each sampled on its own (seeded: seed + i)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])  # a signed 64-bit integer, as vLLM's
    stream: bool = False
    stream_options: StreamOptions | None = None
    infinigen: KVOverrides | None = None
    # accepted only at their no-op values (UNSUPPORTED)
    best_of: Any = None
    suffix: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None

    def check(self) -> None:
        """Refuse what the server would silently get wrong."""
        for name, fine in self.unsupported.items():
            value = getattr(self, name)
            if not any(_same(value, f) for f in fine):
                raise APIError(400, f"{name}={value!r} is not supported by this server (accepted: {fine[1]!r})", name)
        try:
            check_stops(self.stops())
        except InfinigenError as e:
            raise APIError(400, str(e), "stop") from None
        for s in self.stops():
            text_param(s, "stop", "stop")

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(BaseRequest):
    # text, texts, token ids, or lists of token ids (what lm-evaluation-harness sends with a tokenizer)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: only with echo (score the prompt)
    echo: bool = False  # the prompt comes back before the completion (with its logprobs when `logprobs` is set)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # each token's logprob and this many alternatives

    def check(self) -> None:
        super().check()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                400, "max_tokens 0 asks for nothing: set echo to score the prompt, or ask for >= 1", "max_tokens"
            )

    def prompts(self, tok, vocab: int) -> list[tuple[list[int], str | None]]:
        """Each prompt as (token ids, its text: None for ids given as ids)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise APIError(400, "prompt is an empty list: send a string, strings, token ids or lists of them", "prompt")
        if len(p) > MAX_PROMPTS:
            raise APIError(400, f"{len(p)} prompts in one request; send at most {MAX_PROMPTS}", "prompt")
        out = []
        for i, one in enumerate(p):
            if isinstance(one, str):
                out.append((tok.encode(text_param(one, "prompt", "prompt")), one))
                continue
            bad = next((t for t in one if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt[{i}]: token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")
            out.append((list(one), None))
        return out


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    # OpenAI's roles without tools; "developer" is OpenAI's newer name for "system"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self, i: int) -> str:
        if self.content is None:
            raise APIError(400, f"messages[{i}].content is required (text only: tools are not supported)", "messages")
        if isinstance(self.content, str):
            return self.content
        if any(p.type != "text" or p.text is None for p in self.content):
            raise APIError(400, f"messages[{i}].content: only parts of type 'text' are supported", "messages")
        return "".join(p.text for p in self.content)


class ChatRequest(BaseRequest):
    unsupported: ClassVar[dict] = {**UNSUPPORTED, "echo": (None, False)}
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False  # each new token's logprob
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # and this many alternatives (needs logprobs)
    echo: Any = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")

    def n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def plain_messages(self) -> list[dict]:
        """The messages as the chat template takes them; every text checked to be Unicode."""
        out = []
        for i, m in enumerate(self.messages):
            out.append({"role": "system" if m.role == "developer" else m.role, "content": m.text(i)})
            text_param(out[-1]["content"], f"messages[{i}].content", "messages")
        return out


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the bundle's template."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def prompt_text(self) -> str:
        if self.prompt is None:
            raise APIError(400, "send a prompt (a string) or messages", "prompt")
        return text_param(self.prompt, "prompt", "prompt")

    def plain_messages(self) -> list[dict]:
        return ChatRequest(messages=self.messages).plain_messages()


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int]


def text_param(text: str, what: str, param: str) -> str:
    """`text` when it is Unicode text; a 400 naming `param` for a lone surrogate ("\\ud800" is valid JSON)."""
    try:
        check_text(text, what)
    except InfinigenError as e:
        raise APIError(400, str(e), param) from None
    return text


def _same(a, b) -> bool:
    # 0 == False in Python, but logprobs=0 asks for something logprobs=false does not
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A pydantic/FastAPI validation error list -> (one clear message, the offending top-level param)."""
    e = errors[0]
    loc = [p for p in e.get("loc", ()) if not _is_type_tag(p)]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', 'decode error')})", None
    if loc and loc[0] == "body":
        loc = loc[1:]
    if not loc:
        return "the request body must be a JSON object", None
    path = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(loc))
    return f"{path}: {e.get('msg', 'invalid value')}", str(loc[0])


def _is_type_tag(p) -> bool:
    # pydantic names the member of a union that failed: ('prompt', 'str'), ('stop', 'list[str]', 0)
    return isinstance(p, str) and (p in ("str", "int", "float", "bool", "none") or "[" in p)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": use}  # fmt: skip


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chat_body(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": use}  # fmt: skip


def chat_choice(index: int, text: str, finish: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish}  # fmt: skip


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None = None, index: int = 0,
                     logprobs: dict | None = None) -> dict:  # fmt: skip
    choice = completion_choice(index, text, finish, logprobs)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None = None, index: int = 0,
               logprobs: dict | None = None) -> dict:  # fmt: skip
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def _lp(x: float) -> float:
    return max(x, MIN_LOGPROB)


def completion_logprobs(entries: list[Logprob | None], piece, offset: int, first: int | None = None) -> dict:
    """The legacy completions `logprobs` object over `entries` (None: the prompt's first token, `first`, which has
    nothing before it to score it): tokens, token_logprobs, top_logprobs (token -> logprob, the chosen token among
    them, as vLLM) and text_offset (from `offset`, each token's text length after the one before). `piece(id)`: a
    token's text."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        offsets.append(offset)
        if e is None:
            tokens.append(piece(first))
            offset += len(tokens[-1])
            lps.append(None)
            tops.append(None)
            continue
        text = piece(e.token)
        tokens.append(text)
        offset += len(text)
        lps.append(_lp(e.logprob))
        tops.append({**{piece(t): _lp(v) for t, v in e.top}, text: _lp(e.logprob)})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[Logprob], piece, token_bytes) -> dict:
    """The chat `logprobs` object: content, one {token, logprob, bytes, top_logprobs} per new token. `piece(id)`:
    a token's text; `token_bytes(id)`: its own bytes (Tokenizer.token_bytes), which OpenAI's `bytes` are, so the
    text's UTF-8 is the tokens' bytes joined even where a token holds part of a character (its text, alone, is
    U+FFFD)."""

    def one(t: int, v: float) -> dict:
        return {"token": piece(t), "logprob": _lp(v), "bytes": list(token_bytes(t))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries],
            "refusal": None}  # fmt: skip
