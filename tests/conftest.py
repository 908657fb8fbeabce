import pytest
import torch

from kvstack.corpus.data import TokenCache, corpus_files, stdlib_root, train_tokenizer

# The tests run tiny tensors: one thread is faster than two, and immune to a busy machine
# (two OpenMP pools spinning on two cores slow small ops down by orders of magnitude).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """A BPE tokenizer of 512 trained on the standard library's five json modules, and
    their token cache: real code in seconds."""
    root = stdlib_root() / "json"
    files = corpus_files(root)
    path = tmp_path_factory.mktemp("data")
    tokenizer = train_tokenizer(root, files, 512, path / "tokenizer.json")
    return tokenizer, TokenCache.build(root, files, tokenizer, path / "tokens.npy")
