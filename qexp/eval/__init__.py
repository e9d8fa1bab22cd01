"""Evaluation: log-likelihoods and perplexity metrics of one phase (perplexity.py), comparisons between phases
(compare.py)."""
