"""Where a model comes from: the bundled model's directory, a model directory's tokenizer
checked before anything loads, and the model itself (a checkpoint, or random weights for a
preset). `LLM` and the tensor-parallel ranks load through the same functions."""

from importlib import resources
from pathlib import Path

import torch

from kvstack.config import ModelConfig, preset
from kvstack.engine.tokenizer import ByteTokenizer, JsonTokenizer, Tokenizer
from kvstack.model import Model


def bundled_model() -> Path:
    """Where the package keeps the bundled default model."""
    return Path(str(resources.files("kvstack") / "data" / "default"))


def load_tokenizer(model: str | Path | ModelConfig, random_init: bool) -> Tokenizer:
    """The model's tokenizer, once the model directory is checked to hold what loads."""
    if random_init:
        return ByteTokenizer()
    directory = bundled_model() if str(model) == "default" else Path(model)
    if str(model) == "default" and not (directory / "model.safetensors").is_file():
        raise ValueError("no bundled default model yet: pass a model directory, or a "
                         "preset name with random_init=True")
    if not directory.is_dir():
        raise ValueError(f"model {directory}: not a directory (nor random_init=True with "
                         "a preset name)")
    for name in ("config.json", "tokenizer.json"):
        if not (directory / name).is_file():
            raise ValueError(f"model {directory}: {name} is missing (or not a regular file)")
    # A FIFO, socket or device under a weights name would block or never end the read.
    for path in directory.glob("*.safetensors*"):
        if not path.is_file():
            raise ValueError(f"model {directory}: {path.name} is not a regular file")
    return JsonTokenizer(directory / "tokenizer.json")


def check_vocab(model: Model, tokenizer: Tokenizer, name: object) -> None:
    """A tokenizer whose ids the model's embedding does not cover is refused."""
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"model {name}: the tokenizer has {tokenizer.vocab_size} tokens, the "
                         f"model's vocabulary only {model.config.vocab_size}")


def load_model(model: str | Path | ModelConfig, random_init: bool, seed: int,
               device: torch.device, numerics: str, dtype: str) -> tuple[Model, Tokenizer]:
    """A model (a directory, `default`, or a preset / config with random weights seeded
    by `seed`) on `device` in eval mode, its matrices in `dtype` (kvstack.config.DTYPES;
    "auto": bf16 where the checkpoint stores them so), and its tokenizer, each checked."""
    tokenizer = load_tokenizer(model, random_init)
    if random_init:
        torch.manual_seed(seed)
        loaded = Model(model if isinstance(model, ModelConfig) else preset(str(model)))
        loaded.set_numerics(numerics)
    else:
        directory = bundled_model() if str(model) == "default" else Path(model)
        loaded = Model.from_pretrained(directory, numerics=numerics)
    check_vocab(loaded, tokenizer, model)
    if dtype == "bfloat16" or (dtype == "auto"
                               and loaded.stored_matrix_dtype is torch.bfloat16):
        loaded.narrow_matrices()
    return loaded.to(device).eval(), tokenizer
