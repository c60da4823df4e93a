"""Corpus -> tokenizer workers -> Megatron indexed shards -> blended, deterministic batches."""
from .corpus import Document, corpus_files, corpus_fingerprint, is_validation, read_documents
from .datasets import Source, open_blend, open_source, parse_blend
from .indexed import IndexedFile, IndexedWriter
from .pipeline import PrepareSettings, run_prepare
from .prepare import PreparedData, data_key, load_datasets, load_prepared, prepare_data
from .sampler import TrainSampler, eval_batches, rank_slice
from .tokenizer import Tokenizer, train_tokenizer
from .stream import TokenStream
from .unigram import unigram_log_probs, unigram_perplexity

__all__ = [
    "Document", "corpus_files", "corpus_fingerprint", "is_validation", "read_documents", "PreparedData", "data_key",
    "load_prepared", "prepare_data", "load_datasets", "Source", "open_blend", "open_source", "parse_blend",
    "IndexedFile", "IndexedWriter", "PrepareSettings", "run_prepare", "TokenStream", "TrainSampler", "eval_batches", "rank_slice", "Tokenizer", "train_tokenizer",
    "unigram_log_probs", "unigram_perplexity",
]
