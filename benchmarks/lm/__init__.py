"""A real LM (SmolLM2-135M from its GGUF, on English text): the recipe's quality A/Bs through
the CLI, the train step as sites grow, precision, and the torch reference's LM step.
"""
