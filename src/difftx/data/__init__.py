"""Data: corpora, tokenizers, token shards and synthetic tasks."""

from .tokenizers import ByteTokenizer, CharTokenizer, Tokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "CharTokenizer", "Tokenizer", "load_tokenizer"]
