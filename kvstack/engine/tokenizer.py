"""Tokenizers: bytes for random-init models, `tokenizer.json` for trained ones."""

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then bos (256), eos (257), pad (258)."""

    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A `tokenizers` tokenizer.json; eos is the first of its special tokens named like
    an end of sequence."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own exception type
            raise ValueError(f"tokenizer {path}: cannot load ({e})") from e
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = next((self._tok.token_to_id(t) for t in ("<|eos|>", "</s>", "<eos>")
                            if self._tok.token_to_id(t) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)
