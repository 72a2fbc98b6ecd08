"""Fixtures shared by several test files."""
import pytest
from transformers import AutoTokenizer

from services.demo import build_tokenizer, conversations


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    """A real tokenizer trained on the fly on demo chat text (no download)."""
    texts = [m["content"] for c in conversations(300, seed=1) for m in c["messages"]]
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(texts, vocab_size=600).save_pretrained(path)
    return path


@pytest.fixture
def tokenizer(tok_dir):
    return AutoTokenizer.from_pretrained(tok_dir)
