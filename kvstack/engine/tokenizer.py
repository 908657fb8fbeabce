"""Tokenizers: bytes for random-init models, `tokenizer.json` for trained ones."""

import hashlib
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_id: int | None
    vocab_size: int
    digest: str  # what the ids mean: part of what cached blocks and sessions are keyed by

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Text of ids; special tokens ("<|eos|>") left out unless skip_special=False."""
        ...

    def grammar_vocab(self) -> tuple[list[str] | list[bytes], str]:
        """Every token by id as a grammar library reads it ("" for special tokens, which
        no text contains), and how they are written: "raw" bytes or "byte_level"."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then bos (256), eos (257), pad (258)."""

    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259
    digest = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        if skip_special:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        special = {self.bos_id: "<|bos|>", self.eos_id: "<|eos|>", self.pad_id: "<|pad|>"}
        parts, run = [], []
        for i in ids:
            if i in special:
                parts += [bytes(run).decode("utf-8", errors="replace"), special[i]]
                run = []
            else:
                run.append(i)
        return "".join([*parts, bytes(run).decode("utf-8", errors="replace")])

    def grammar_vocab(self) -> tuple[list[str] | list[bytes], str]:
        return [bytes([i]) for i in range(256)] + [b""] * (self.vocab_size - 256), "raw"


def byte_level_tokenizer_json() -> str:
    """A tokenizer.json of bytes alone (byte-level BPE without merges: 256 byte symbols,
    then <|bos|> and <|eos|>): what a model directory written from random weights ships,
    so that any tool loading the directory finds a tokenizer."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>"])
    return tok.to_str()


class JsonTokenizer:
    """A `tokenizers` tokenizer.json; eos is the first of its special tokens named like
    an end of sequence."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        try:
            self.digest = hashlib.sha256(path.read_bytes()).hexdigest()
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own exception type
            raise ValueError(f"tokenizer {path}: cannot load ({e})") from e
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = next((self._tok.token_to_id(t) for t in ("<|eos|>", "</s>", "<eos>")
                            if self._tok.token_to_id(t) is not None), None)

    def encode(self, text: str) -> list[int]:
        # encode_batch lets go of the interpreter while it works (encode holds it), so a
        # server's event loop tokenizing a long prompt does not stall the engine thread;
        # the ids are the same.
        return self._tok.encode_batch([text])[0].ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def grammar_vocab(self) -> tuple[list[str] | list[bytes], str]:
        special = {t.content for t in self._tok.get_added_tokens_decoder().values()
                   if t.special}
        vocab = [""] * self.vocab_size
        for token, i in self._tok.get_vocab().items():
            vocab[i] = "" if token in special else token
        byte_level = type(self._tok.decoder).__name__ == "ByteLevel"
        if not byte_level:
            vocab = [self._tok.decode([i]) if t else "" for i, t in enumerate(vocab)]
        return vocab, "byte_level" if byte_level else "raw"
