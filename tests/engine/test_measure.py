"""MFU is per device: one device's FLOPs (XLA's count of the partitioned program) over one
device's peak, so the same global batch reports the same MFU on 1 device and on 4."""

from __future__ import annotations

import jax
import pytest
from helpers import make_run, pretrain_on

from pdctl.engine import measure, sharding


@pytest.mark.slow
@pytest.mark.parametrize("template", ["resid-mlp", "llama-mlp"])
def test_mfu_of_the_same_global_batch_matches_on_1_and_4_devices(tmp_path, template):
    # The templates' own sizes (not the tiny test sizes): the matmuls must dominate the
    # replicated optimizer update, as in any model worth measuring.
    batch = 512 if template == "resid-mlp" else 16
    run = make_run(tmp_path, template, tiny=False, pretrain={"batch_size": batch})
    flops = {}
    for n in (1, 4):
        pt = pretrain_on(run, sharding.make_mesh(n, 1, jax.devices()[:n]))  # data = n
        compiled = pt.step_fn().lower(pt.init_state(), pt.batch(0)).compile()
        flops[n] = measure.step_flops(compiled)
    # A quarter of the batch per device: a quarter of the FLOPs, plus the all-reduces and the
    # replicated optimizer update, which are small next to the matmuls. Stated tolerance 5%.
    assert flops[4] * 4 == pytest.approx(flops[1], rel=0.05), flops
    # Four devices that each take a quarter of the time are as utilised as one.
    peak, step_s = 1e12, 0.02
    assert measure.mfu(flops[4], step_s / 4, peak) == pytest.approx(
        measure.mfu(flops[1], step_s, peak), rel=0.05
    )
    # and the loop's figure is exactly that
    assert measure.mfu(flops[1], step_s, peak) == flops[1] / step_s / peak


def test_the_loops_flops_count_a_scans_matmuls_per_iteration(tmp_path):
    """The loop's FLOPs (its MFU's numerator) are the step's matmul FLOPs with a scan's body
    counted once per iteration, one device's share: XLA's cost_analysis counts the body once."""
    import jax.numpy as jnp
    from helpers import make_loop

    from pdctl.engine.loop import loop_counters

    def step(state, batch):
        x = jax.lax.scan(lambda c, _: (jnp.tanh(c @ c), None), state["x"], None, length=10)[0]
        loop = {**state["loop"], "step": state["loop"]["step"] + 1}
        return {"x": x, "loop": loop}, {"loss": jnp.sum(x), "max_bad_run": loop["max_bad_run"]}

    state = {"x": jnp.eye(64) * 0.5, "loop": loop_counters(jax.random.PRNGKey(0))}
    loop, _, _ = make_loop(jax.jit(step, donate_argnums=0), state, tmp_path, total=1, log_every=1)
    compiled = loop.compile()
    one = 2.0 * 64**3  # one 64 x 64 @ 64 x 64
    assert loop.flops_per_step == 10 * one / jax.device_count()
    assert measure.step_flops(compiled) < 2 * one  # XLA: the body once (plus the tanh)


def test_the_device_peak_is_buffers_plus_reservations_and_none_without_statistics() -> None:
    """A TPU runtime reserves an executable's temporaries apart from the buffers in use: the
    peak adds both (the largest over the devices); XLA:CPU has no statistics: None."""
    from types import SimpleNamespace

    def dev(stats):
        return SimpleNamespace(memory_stats=lambda: stats)

    a = dev({"peak_bytes_in_use": 6, "peak_bytes_reserved": 7, "bytes_in_use": 5})
    b = dev({"peak_bytes_in_use": 10})  # a backend without reservations
    assert measure.device_peak_bytes([a, b]) == 13
    assert measure.device_peak_bytes([dev(None), dev({})]) is None
    assert measure.device_peak_bytes(jax.devices()) is None  # XLA:CPU
