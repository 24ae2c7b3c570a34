"""Stochastic Parameter Decomposition: components, CI functions, masks, losses, evaluation."""
