"""A Hugging Face checkpoint folder: config.json, safetensors shards (with or without an index) or
pytorch_model*.bin files, and a tokenizer (tokenizer.json, or GPT-2 style vocab.json + merges.txt)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from infinigen_prep.sources.base import Source, TokenizerInfo
from infinigen_rt.errors import InfinigenError
from infinigen_rt.files import read_json


def _read_json(path: Path) -> dict:
    value = read_json(path, str(path), "is it a Hugging Face checkpoint folder?")
    if not isinstance(value, dict):
        raise InfinigenError(f"{path} holds a JSON {type(value).__name__}, not an object; is it a Hugging Face "
                             "checkpoint folder?")  # fmt: skip
    return value


def _token_str(v) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as {"content": ...} objects
    return v.get("content") if isinstance(v, dict) else v


def card_license(readme: Path) -> str | None:
    """The `license:` of a model card's YAML front matter, if any."""
    if not readme.is_file():
        return None
    text = readme.read_text(encoding="utf-8", errors="replace")
    m = re.match(r"^---\n(.*?)\n---", text, re.S)
    if m:
        lic = re.search(r"^license:\s*(\S+)", m.group(1), re.M)
        return lic.group(1).strip("'\"") if lic else None
    return None


class LocalSource(Source):
    """Reads tensors lazily: safetensors through safe_open, .bin through torch.load(mmap, weights_only)."""

    def __init__(self, path: Path, provenance: dict | None = None):
        super().__init__()
        self.path = path
        if not (path / "config.json").is_file():
            raise InfinigenError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
        self.config = _read_json(path / "config.json")
        # the folder's name, never its local path: bundle.json is published with the bundle
        self.provenance = provenance or {"kind": "local", "name": path.resolve().name}
        self.license = card_license(path / "README.md")
        self._index: dict[str, Path] = {}  # tensor name -> file
        self._handles: dict[Path, object] = {}
        safetensors = sorted(path.glob("*.safetensors"))
        bins = sorted(p for p in path.glob("pytorch_model*.bin"))
        if safetensors:
            self._kind = "safetensors"
            for f in safetensors:
                for name in self._open(f).keys():
                    self._index[name] = f
        elif bins:
            self._kind = "bin"
            for f in bins:
                for name in self._open(f):
                    self._index[name] = f
        else:
            raise InfinigenError(f"{path} has no *.safetensors or pytorch_model*.bin weights")

    def _open(self, f: Path):
        if f not in self._handles:
            try:
                if self._kind == "safetensors":
                    from safetensors import safe_open

                    self._handles[f] = safe_open(f, framework="pt")
                else:
                    self._handles[f] = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:  # safetensors / pickle errors: the file is corrupt or foreign
                raise InfinigenError(f"{f.name} is not a readable {self._kind} weight file ({e})") from None
        return self._handles[f]

    def names(self) -> list[str]:
        return list(self._index)

    def shape(self, name: str) -> tuple[int, ...]:
        h = self._open(self._index[name])
        if self._kind == "safetensors":
            return tuple(h.get_slice(name).get_shape())
        return tuple(h[name].shape)

    def load(self, name: str) -> torch.Tensor:
        h = self._open(self._index[name])
        try:
            return h.get_tensor(name) if self._kind == "safetensors" else h[name]
        except Exception as e:
            raise InfinigenError(f"cannot read tensor {name} from {self._index[name].name} ({e})") from None

    def generation_eos_ids(self) -> list[int]:
        f = self.path / "generation_config.json"
        if not f.is_file():
            return []
        eos = _read_json(f).get("eos_token_id")
        return [eos] if isinstance(eos, int) else list(eos or [])

    def tokenizer(self) -> TokenizerInfo:
        p = self.path
        tc = _read_json(p / "tokenizer_config.json") if (p / "tokenizer_config.json").is_file() else {}
        template = tc.get("chat_template")
        if (p / "chat_template.jinja").is_file():
            template = (p / "chat_template.jinja").read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: keep the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        is_opt = self.config.get("model_type") == "opt"
        info = TokenizerInfo(
            tokenizer_json="",
            bos_token=_token_str(tc.get("bos_token")),
            eos_token=_token_str(tc.get("eos_token")),
            pad_token=_token_str(tc.get("pad_token")),
            add_bos_token=bool(tc.get("add_bos_token", is_opt)),
            chat_template=template,
        )
        if (p / "tokenizer.json").is_file():
            info.tokenizer_json = (p / "tokenizer.json").read_text(encoding="utf-8")
        elif (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
            info.tokenizer_json = byte_level_bpe(p / "vocab.json", p / "merges.txt", info)
        else:
            raise InfinigenError(
                f"{p} has no tokenizer.json (nor GPT-2 style vocab.json + merges.txt); "
                "save one with transformers' fast tokenizer first"
            )
        return info


def byte_level_bpe(vocab: Path, merges: Path, info: TokenizerInfo) -> str:
    """A GPT-2 style byte-level BPE tokenizer (OPT ships these files) as tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [t for t in (info.bos_token, info.eos_token, info.pad_token) if t]
    tok.add_special_tokens(list(dict.fromkeys(specials)))
    if info.add_bos_token and info.bos_token:
        bos_id = tok.token_to_id(info.bos_token)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{info.bos_token} $A",
            pair=f"{info.bos_token} $A {info.bos_token} $B",
            special_tokens=[(info.bos_token, bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str()
