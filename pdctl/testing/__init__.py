"""What pdctl's tests and its benchmarks both build on, in one place that both import (the
benchmarks never reach into tests/): tiny run directories and their steps (`runs`), tiny
Hugging Face models (`models`), a synthetic whole-model harvest (`harvest`) and a headless
browser (`browser`). pdctl itself never imports this package (tests/test_layering.py).
"""
