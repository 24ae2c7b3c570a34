"""Is donation really happening? Bytes-weighted buffer-pointer reuse of a donating call.

Donation can fail silently (a layout or sharding mismatch, or arrays that came back from orbax),
and then the old and new state stay resident together. Before the call, record the device
buffers of the donated arguments; after it, the fraction of those bytes whose pointers reappear
in the outputs is the fraction XLA actually reused.
"""

from __future__ import annotations

from typing import Any

import jax

THRESHOLD = 0.95


def buffer_bytes_by_ptr(tree: Any) -> dict[int, int]:
    """{device buffer pointer: bytes} over every addressable shard of every array in `tree`."""
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            out[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return out


def reused_fraction(before: dict[int, int], outputs: Any) -> tuple[float, int]:
    """(bytes-weighted fraction of `before` reused by `outputs`, bytes not reused)."""
    total = sum(before.values())
    if total == 0:
        return 1.0, 0
    after = buffer_bytes_by_ptr(outputs)
    reused = sum(n for ptr, n in before.items() if ptr in after)
    return reused / total, total - reused


def report(stage: str, fraction: float, missed: int, echo=print) -> bool:
    """Print `DONATION FAILED` below the threshold; True when donation worked."""
    if fraction < THRESHOLD:
        echo(
            f"DONATION FAILED in {stage}: only {fraction:.1%} of the donated bytes were reused "
            f"({missed / 2**20:.2f} MiB not reused); old and new state are both resident"
        )
        return False
    return True
