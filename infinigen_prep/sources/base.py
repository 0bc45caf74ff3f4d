"""What every checkpoint source gives the converter: an HF-style config, tensors by HF name, a tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenizerInfo:
    """A tokenizer ready for the bundle: `tokenizer_json` is the serialized `tokenizers` JSON."""

    tokenizer_json: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    add_bos_token: bool = False
    chat_template: str | None = None


@dataclass
class Source:
    """A checkpoint to convert. Subclasses fill `config` (the HF `config.json` dict, `model_type` set)
    and `provenance` (goes to bundle.json["source"]) and implement the tensor and tokenizer access."""

    config: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    license: str | None = None
    base_model: str | None = None  # a Hub repo id, for the model card

    def names(self) -> list[str]:
        """Tensor names in Hugging Face transformers naming (e.g. `model.layers.0.self_attn.q_proj.weight`)."""
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def load(self, name: str) -> torch.Tensor:
        """One tensor, in HF layout, any float dtype (the converter casts)."""
        raise NotImplementedError

    def tokenizer(self) -> TokenizerInfo:
        raise NotImplementedError

    def generation_eos_ids(self) -> list[int]:
        """Extra end-of-sequence ids (generation_config.json); empty when the source has none."""
        return []
