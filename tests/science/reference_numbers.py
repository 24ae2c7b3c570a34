"""Numbers from goodfire-ai/spd's torch code for tests/science/test_recipe_ci.py and
tests/science/test_ci_global.py (run by hand, never a test: it needs a copy of that repository
and its deps, einops and jaxtyping; it sits beside the tests it feeds, whose cases it imports,
and pytest does not collect it).

    git --git-dir=<spd mirror> archive feature/misc-improvements spd | tar -x -C /tmp/spd
    pip install --target /tmp/refdeps einops jaxtyping
    PYTHONPATH=/tmp/spd:/tmp/refdeps python tests/science/reference_numbers.py

Prints the lower-leaky hard sigmoid's values and gradients, the one-site
`GlobalSharedTransformerCiFn`'s output on `transformer_case()`, and the three-site one's on
`test_ci_global.global_case()` (its `SPD_GLOBAL`), with the largest differences between the
reference module, the test's torch port of it and pdctl's forward on every logit."""

from __future__ import annotations

import typing

import numpy as np
import torch
import typing_extensions

typing.override = typing_extensions.override  # the reference needs Python 3.12's typing

from spd.models import sigmoids  # noqa: E402
from spd.models.components import GlobalSharedTransformerCiFn, TargetLayerConfig  # noqa: E402
from test_ci_global import (  # noqa: E402
    FFN,
    HEADS,
    N_BLOCKS,
    SITES,
    D,
    _logits,
    global_case,
    run_torch_reference,
    torch_reference,
)
from test_recipe_ci import G, Z, transformer_case  # noqa: E402


def sigmoid_numbers() -> None:
    f = sigmoids.SIGMOID_TYPES["lower_leaky_hard"]
    for sign in (1.0, -1.0):
        z = torch.tensor(Z, requires_grad=True)
        y = f(z)
        (y * sign * torch.tensor(G)).sum().backward()
        print("lower_leaky_hard", sign, np.round(y.tolist(), 6), np.round(z.grad.tolist(), 6))


def transformer_numbers() -> None:
    params, x = transformer_case()
    d_in, d = params["in"]["W"].shape
    C = params["out"]["W"].shape[1]
    H = params["blocks"]["wq"].shape[2]
    ffn = params["blocks"]["w1"].shape[2]
    ref = GlobalSharedTransformerCiFn(
        {"s": TargetLayerConfig(input_dim=d_in, C=C)}, d_model=d, n_layers=1, n_heads=H,
        mlp_hidden_dims=[ffn],
    )  # fmt: skip
    t = lambda a: torch.tensor(np.asarray(a))  # noqa: E731
    b = {k: v[0] for k, v in params["blocks"].items()}
    with torch.no_grad():
        ref._input_projector.W.copy_(t(params["in"]["W"]))
        ref._input_projector.b.copy_(t(params["in"]["b"]))
        ref._output_head.W.copy_(t(params["out"]["W"]))
        ref._output_head.b.copy_(t(params["out"]["b"]))
        blk = ref._blocks[0]
        # torch Linear: y = x @ weight.T; pdctl: (d, heads, head_dim) / (heads, head_dim, d)
        for name, key in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv")):
            getattr(blk.attn, name).weight.copy_(t(b[key].reshape(d, d).T))
        blk.attn.out_proj.weight.copy_(t(b["wo"].reshape(d, d).T))
        blk.mlp[0].W.copy_(t(b["w1"]))
        blk.mlp[0].b.copy_(t(b["b1"]))
        blk.mlp[2].W.copy_(t(b["w2"]))
        blk.mlp[2].b.copy_(t(b["b2"]))
        z = ref({"s": t(x)})["s"].numpy()
    print("transformer", np.round([z[0, 0], z[0, 4], z[1, 2]], 6).tolist())


def global_numbers() -> None:
    """The real module and the test's port loaded with the same weights (pdctl's layout mapped
    by `reference_state_dict`), on the same inputs."""
    ci_fns, x = global_case()
    ref = GlobalSharedTransformerCiFn(
        {p: TargetLayerConfig(input_dim=d_in, C=C) for p, (d_in, C) in SITES.items()},
        d_model=D, n_layers=N_BLOCKS, n_heads=HEADS, mlp_hidden_dims=[FFN],
    )  # fmt: skip
    real = run_torch_reference(ref, ci_fns, x)
    port = run_torch_reference(torch_reference(SITES, D, N_BLOCKS, HEADS, FFN), ci_fns, x)
    ours = _logits(ci_fns, x)
    for p in SITES:
        z = real[p]
        rows = ", ".join("[" + ", ".join(f"{v:.6f}" for v in r) + "]"
                         for r in (z[0, 0], z[0, 4], z[1, 2]))  # fmt: skip
        print(f"global {p!r}: [{rows}]")
    diff = lambda a, b: max(float(np.abs(a[p] - b[p]).max()) for p in SITES)  # noqa: E731
    scale = max(float(np.abs(real[p]).max()) for p in SITES)
    print(f"global: max |logit| {scale:.3f}; max abs diff reference - port {diff(real, port):.3g},"
          f" reference - pdctl {diff(real, ours):.3g}")  # fmt: skip


if __name__ == "__main__":
    sigmoid_numbers()
    transformer_numbers()
    global_numbers()
