"""Deprecated: the names `attnlab.train.loop` still imports from here, until it imports them from
their modules (byte corpora: data/byte_corpus.py; every corpus: data/corpus.py). Import nothing new
from this module, and never import it from `attnlab.data`: it imports data/corpus.py, so an import
back would make a cycle (tests/test_data.py checks the graph)."""

from attnlab.data.byte_corpus import ByteCorpus
from attnlab.data.corpus import load_corpus

__all__ = ["ByteCorpus", "load_corpus"]
