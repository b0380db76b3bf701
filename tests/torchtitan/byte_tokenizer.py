"""A byte-level tokenizer for torchtitan's Trainer in tests (no hub, no tokenizer files)."""
from __future__ import annotations

from dataclasses import dataclass

from torchtitan.components.tokenizer import BaseTokenizer


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as tokens 0-255, BOS 256, EOS 257 (the debug model's vocabulary is 2048)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str | None = None):
        super().__init__()
        self.bos_id, self.eos_id = 256, 257

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        return [self.bos_id] * add_bos + list(text.encode("utf-8")) + [self.eos_id] * add_eos

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")

    def get_vocab_size(self) -> int:
        return 258
