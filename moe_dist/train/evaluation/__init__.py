"""Evaluation in one place: validation loss and the unigram baseline (used while training) and the
evaluation of a saved model (``moe-dist eval``)."""
