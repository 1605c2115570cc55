"""Kinds of training (causal LM pretraining, ...): data, loss, evaluation and log keys (spec/task.py)."""
