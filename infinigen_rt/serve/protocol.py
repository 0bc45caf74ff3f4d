"""The OpenAI wire format: request models (strict pydantic), errors, and the response and chunk bodies."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from infinigen_rt.errors import InfinigenError
from infinigen_rt.policies.options import SPEC_KEYS
from infinigen_rt.tokenizer import check_text

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS = 512  # OpenAI's chat default is "whatever fits"; on a CPU that is too long to wait for


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


class KVOverrides(BaseModel):
    """The per-request `infinigen` object: KV options for this request's batch."""

    model_config = ConfigDict(extra="forbid", strict=True)
    alpha: float | None = Field(None, ge=0)
    budget: float | None = Field(None, gt=0, le=1)
    spec_keys: Literal[SPEC_KEYS] | None = None  # the request's sequences build their own speculation keys
    correct: float | None = Field(None, ge=0, lt=1)

    def changes(self) -> dict[str, Any]:
        return {name: v for name in type(self).model_fields if (v := getattr(self, name)) is not None}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


# fields that would change what comes back, and the values that leave it unchanged
UNSUPPORTED = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
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
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what a torch generator takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    infinigen: KVOverrides | None = None
    # accepted only at their no-op values (UNSUPPORTED)
    n: Any = None
    best_of: Any = None
    echo: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
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
        for name, fine in UNSUPPORTED.items():
            value = getattr(self, name)
            if not any(_same(value, f) for f in fine):
                raise APIError(400, f"{name}={value!r} is not supported by this server (accepted: {fine[1]!r})", name)
        if any(s == "" for s in self.stops()):
            raise APIError(400, "stop strings must not be empty", "stop")
        for s in self.stops():
            text_param(s, "stop", "stop")

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(BaseRequest):
    prompt: str | list[str]

    def prompt_text(self) -> str:
        if not isinstance(self.prompt, str) and len(self.prompt) != 1:
            raise APIError(400, f"one prompt per request, got a list of {len(self.prompt)}; send one each", "prompt")
        text = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return text_param(text, "prompt", "prompt")


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
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens

    def plain_messages(self) -> list[dict]:
        """The messages as the chat template takes them; every text checked to be Unicode."""
        out = []
        for i, m in enumerate(self.messages):
            out.append({"role": "system" if m.role == "developer" else m.role, "content": m.text(i)})
            text_param(out[-1]["content"], f"messages[{i}].content", "messages")
        return out


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


def completion_body(rid: str, created: int, model: str, text: str, finish: str, use: dict) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chat_body(rid: str, created: int, model: str, text: str, finish: str, use: dict) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
