"""Corpus -> sentencepiece tokenizer -> cached memory-mapped tokens -> deterministic batches."""
from .corpus import Document, corpus_files, corpus_fingerprint, is_validation, read_documents
from .prepare import PreparedData, data_key, load_prepared, prepare_data
from .sampler import TrainSampler, eval_batches, rank_slice
from .tokenizer import Tokenizer, train_tokenizer
from .tokens import TokenFile
from .unigram import unigram_log_probs, unigram_perplexity

__all__ = [
    "Document", "corpus_files", "corpus_fingerprint", "is_validation", "read_documents", "PreparedData", "data_key",
    "load_prepared", "prepare_data", "TrainSampler", "eval_batches", "rank_slice", "Tokenizer", "train_tokenizer",
    "TokenFile", "unigram_log_probs", "unigram_perplexity",
]
