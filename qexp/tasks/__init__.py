"""Task accuracy beside perplexity: lm-eval tasks on a run's phases (docs/tasks.md)."""
