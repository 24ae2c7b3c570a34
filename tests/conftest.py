"""Test setup: 4 simulated CPU devices, set before JAX initialises.

Tests that need one device build their mesh over ``jax.devices()[:1]``; tests that need a
fresh JAX with another device count run a subprocess.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("WANDB_MODE", "disabled")
