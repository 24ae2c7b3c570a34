"""Time before the first step: compiles (layers scanned or unrolled, the decomposition's
init), the persistent compile cache, loading a Hugging Face checkpoint or a GGUF.
"""
