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
