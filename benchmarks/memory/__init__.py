"""Memory: the fit check's estimates against XLA's (an 8B model's, the CPU's margin), what
donation and the train state's memory savers save.
"""
