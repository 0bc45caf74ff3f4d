"""The bundle's tokenizer (`tokenizers` library) with its special tokens and chat template."""

from __future__ import annotations

import functools
import json
import re

from infinigen_rt import chat_template
from infinigen_rt.bundle import TOKENIZER_JSON, Bundle
from infinigen_rt.errors import InfinigenError

# the text of an id the tokenizer has no token for (see Tokenizer.decode)
UNKNOWN = "\ufffd"
# a tokenizer may have fewer tokens than the model has embedding rows (Qwen2.5: 151,665 for 151,936 rows, padded
# to a multiple of 128); one with fewer than this share of the rows is another model's tokenizer
MIN_VOCAB_COVERAGE = 0.5
# more UTF-8 bytes than any real vocabulary's longest token holds (SmolLM2's: 81, a run of spaces): a text longer
# than context x this cannot fit the context, whatever it says (text_limit)
TEXT_BYTES_PER_TOKEN = 256
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


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


def text_limit(context: int) -> int:
    """The most bytes (or characters) of text for a `context`-token model worth tokenizing: a prompt past it is
    refused before it is read whole, a chat template's render stops there."""
    return max(1 << 20, TEXT_BYTES_PER_TOKEN * context)


@functools.lru_cache(maxsize=1)
def byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, reversed: the character a byte-level BPE writes for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Tokenizer:
    """The bundle's tokenizer with its special tokens and chat template, checked against the model's vocabulary."""

    def __init__(self, bundle: Bundle):
        """The bundle's tokenizer, checked against its model: every token id must have a row of the embedding
        (`config.vocab_size`), and the tokenizer must cover most of them."""
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self.tok = HFTokenizer.from_file(str(bundle.path / TOKENIZER_JSON))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise InfinigenError(f"bundle tokenizer is not readable ({e}); re-convert the bundle") from None
        info = bundle.tokenizer
        self.bos_token, self.eos_token = info.bos_token, info.eos_token
        self.chat_template = info.chat_template
        cfg = bundle.config
        self.model_rows = cfg.vocab_size
        self.max_chars = min(chat_template.MAX_CHARS, text_limit(cfg.max_position_embeddings))  # a render stops there
        self._check_vocab()
        self.eos_ids = set(cfg.eos_token_ids)
        if self.eos_token is not None and self.tok.token_to_id(self.eos_token) is not None:
            self.eos_ids.add(self.tok.token_to_id(self.eos_token))
        pad = cfg.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        self._steps = _byte_steps(self.tok)
        self._bytes = functools.lru_cache(maxsize=1 << 16)(self._token_bytes)

    def _check_vocab(self) -> None:
        """A token id past the model's rows would index past its embedding (an IndexError mid-request); a
        tokenizer far smaller than the model is not its tokenizer (the ids it lacks would vanish from the text)."""
        vocab = self.tok.get_vocab(with_added_tokens=True)
        ids = set(vocab.values())
        top, rows = max(ids, default=-1), self.model_rows
        if top >= rows:
            token = next(t for t, i in vocab.items() if i == top)
            shown = token if len(token) <= 40 else token[:40] + "..."
            raise InfinigenError(f"the bundle's tokenizer has token id {top} ({shown!r}), past the model's vocabulary "
                                 f"of {rows:,} rows; re-convert the bundle")  # fmt: skip
        count = self.tok.get_vocab_size(with_added_tokens=True)
        if count < MIN_VOCAB_COVERAGE * rows:
            raise InfinigenError(f"the bundle's tokenizer has {count:,} tokens for the model's {rows:,} rows of "
                                 "vocabulary: it is not this model's tokenizer; re-convert the bundle")  # fmt: skip
        self.n_ids = top + 1  # ids from here to model_rows are the embedding's padding: no token
        self._holes = frozenset(range(self.n_ids)) - ids if len(ids) < self.n_ids else frozenset()
        self._first_missing = min(self._holes, default=self.n_ids)

    def has_token(self, token_id: int) -> bool:
        """Whether the tokenizer has a token for this id (a model may have more rows than tokens)."""
        return 0 <= token_id < self.n_ids and token_id not in self._holes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids; each has a row of the model (else a one-line error, never an IndexError later)."""
        check_text(text, "the text")
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        if ids and (top := max(ids)) >= self.model_rows:  # the load's check makes this unreachable, short of a bug
            raise InfinigenError(f"the bundle's tokenizer encoded the text to token id {top}, past the model's "
                                 f"vocabulary of {self.model_rows:,} rows; re-convert the bundle")  # fmt: skip
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`. An id the tokenizer has no token for (a padded row of the model's embedding, which a
        sampled model may still pick) is written as U+FFFD, the replacement character a decoder also writes for
        bytes that are not text: the tokenizers library would drop it, and the text would lose a token without a
        trace (and `token_bytes` says the same)."""
        if ids and max(ids) >= self._first_missing and not all(map(self.has_token, ids)):
            parts, run = [], []
            for t in ids:
                if self.has_token(t):
                    run.append(t)
                    continue
                if run:  # a missing token breaks the text: each side decodes on its own
                    parts.append(self.tok.decode(run, skip_special_tokens=skip_special_tokens))
                    run = []
                parts.append(UNKNOWN)
            parts.append(self.tok.decode(run, skip_special_tokens=skip_special_tokens) if run else "")
            return "".join(parts)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes in a text (OpenAI's logprobs `bytes`): the text's UTF-8 is its tokens' bytes
        joined, so a byte-level token that holds part of a character gives that part (where `decode([id])` gives
        U+FFFD), and a SentencePiece `<0xNN>` token its byte. Read from the token through the decoder's steps for
        byte-level BPE and SentencePiece vocabularies, else the UTF-8 of the token decoded alone."""
        return self._bytes(token_id)

    def _token_bytes(self, token_id: int) -> bytes:
        if not self.has_token(token_id):
            return UNKNOWN.encode()
        token = self.tok.id_to_token(token_id)
        if self._steps is None or token is None:
            return self.tok.decode([token_id], skip_special_tokens=False).encode("utf-8", "surrogatepass")
        value: str | bytes = token
        for step in self._steps:
            if isinstance(value, bytes):
                break
            value = step(value)
        return value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages with the bundle's Jinja chat template, as transformers does (in a separate, limited
        process: chat_template.py); any failure of the template is a one-line InfinigenError."""
        if not self.chat_template:
            raise InfinigenError("this bundle has no chat template; drop --chat and pass the raw prompt")
        context = {
            "messages": messages,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "add_generation_prompt": add_generation_prompt,
        }
        return chat_template.render(self.chat_template, context, max_chars=self.max_chars)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # the template writes any BOS itself, so no special tokens are added again
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


def _byte_steps(tok) -> list | None:
    """What the tokenizer's decoder does to one token's string on the way to bytes, as functions of a str (a str
    still, or bytes once a step has made them); None for a decoder these do not cover (then token_bytes decodes
    the token alone). Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): the byte-to-unicode table back, or the
    token's own UTF-8 for a token not written in it (the tokenizers library does the same); SentencePiece (Llama 2,
    Mistral, Gemma): its Replace steps ("▁" -> " ") and <0xNN> byte-fallback tokens. A Strip after Fuse trims the
    whole text's first space, not a token's, so it is not a step of a token's bytes."""
    if tok.decoder is None:
        return None
    try:
        spec = json.loads(tok.decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    parts = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]
    steps, fused = [], False
    for d in parts:
        kind = d.get("type")
        if kind == "ByteLevel":
            steps.append(_byte_level)
        elif kind == "ByteFallback":
            steps.append(_byte_fallback)
        elif kind == "Replace":
            pattern, content = d.get("pattern", {}), d.get("content", "")
            if "String" in pattern:
                steps.append(_replacer(pattern["String"], content))
            elif "Regex" in pattern:
                rx = re.compile(pattern["Regex"])
                steps.append(lambda s, rx=rx, content=content: rx.sub(content, s))
            else:
                return None
        elif kind == "Metaspace":
            steps.append(_replacer(d.get("replacement", "▁"), " "))
        elif kind == "Fuse":
            fused = True
        elif kind == "Strip" and fused:
            continue
        else:  # WordPiece, BPE suffixes, CTC, a Strip of every token...: not a byte mapping this follows
            return None
    return steps


def _replacer(old: str, new: str):
    return lambda s: s.replace(old, new)


def _byte_level(token: str) -> bytes:
    table = byte_level_chars()
    if all(c in table for c in token):
        return bytes(table[c] for c in token)
    return token.encode("utf-8")


def _byte_fallback(token: str) -> str | bytes:
    m = _BYTE_TOKEN.fullmatch(token)
    return bytes([int(m[1], 16)]) if m else token
