"""The bundle's tokenizer (`tokenizers` library) with its special tokens and chat template."""

from __future__ import annotations

from infinigen_rt.bundle import TOKENIZER_JSON, Bundle
from infinigen_rt.errors import InfinigenError


def check_text(text: str, what: str) -> None:
    """Refuse a str that is not Unicode text: a lone surrogate (valid JSON: "\\ud800") or a byte that was not
    UTF-8 (Python keeps those of argv as U+DC80..U+DCFF). The tokenizer cannot encode either."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        if 0xDC80 <= ch <= 0xDCFF:  # surrogateescape: the raw byte
            why = f"is not UTF-8 text (byte 0x{ch - 0xDC00:02X} at character {e.start})"
        else:
            why = f"holds a lone surrogate \\u{ch:04x} at character {e.start}, which is not Unicode text"
        raise InfinigenError(f"{what} {why}; send UTF-8 text") from None


class Tokenizer:
    def __init__(self, bundle: Bundle):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self.tok = HFTokenizer.from_file(str(bundle.path / TOKENIZER_JSON))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise InfinigenError(f"bundle tokenizer is not readable ({e}); re-convert the bundle") from None
        info = bundle.tokenizer
        self.bos_token, self.eos_token = info.bos_token, info.eos_token
        self.chat_template = info.chat_template
        cfg = bundle.config
        self.eos_ids = set(cfg.eos_token_ids)
        if self.eos_token is not None and self.tok.token_to_id(self.eos_token) is not None:
            self.eos_ids.add(self.tok.token_to_id(self.eos_token))
        pad = cfg.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_text(text, "the text")
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages with the bundle's Jinja chat template, as transformers does."""
        if not self.chat_template:
            raise InfinigenError("this bundle has no chat template; drop --chat and pass the raw prompt")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise InfinigenError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as e:
            raise InfinigenError(f"the bundle's chat template failed to render: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # the template writes any BOS itself, so no special tokens are added again
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)
