"""`LMTarget`: what the decoder LMs (`llama_mlp`, `hf`) share.

Both are stacks of blocks over tokens whose site paths read `<layer_prefix>.<i>.<name>`, and both
train by next-token cross-entropy on packed text. A subclass names its layer prefix, the sites of
one layer (`layer_sites`) and which of them are MLP projections (`NEURON_SIDES`); the site layout,
`layer_of`, the neuron sides, rematerialisation and the training interface come from here, as
does the rotary embedding both forwards apply alike (`rope`; each computes its own inverse
frequencies). Their RMSNorms stay their own: the two multiply the scale in opposite operand
orders, which leaves the forward bit-identical but not XLA's gradients.
"""

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import optax

from pdctl.science import arrays
from pdctl.science.arrays import REMAT_POLICIES
from pdctl.science.targets.base import Params, Target


class LMTarget(Target):
    """Base class of the decoder LMs. Subclasses are frozen dataclasses with the fields
    `seq_len` (tokens per example) and `remat` (none | dots_saveable | full: rematerialise each
    block in the backward), expose `n_layers`, and implement `layer_prefix` and `layer_sites`.
    """

    output_kind = "logits"
    # {name within a layer: "out" | "in"} of the MLP projections (`mlp_neuron_sides`)
    NEURON_SIDES: ClassVar[Mapping[str, str]] = {}

    seq_len: int
    remat: str
    if TYPE_CHECKING:  # a field of the subclass (LlamaMLP) or a property (HFCausalLM: its spec's)

        @property
        def n_layers(self) -> int: ...

    def _check_remat(self) -> None:
        if self.remat not in ("none", *REMAT_POLICIES):
            raise ValueError(f"remat must be one of none, {', '.join(REMAT_POLICIES)}")

    # Layout.

    def layer_prefix(self) -> str:
        """The path of the list of blocks: site paths are `<layer_prefix>.<i>.<name>`."""
        raise NotImplementedError

    def layer_sites(self) -> list[tuple[str, tuple[int, int], bool]]:
        """(name within the layer, (d_in, d_out), has bias) of one layer's sites, in forward
        order."""
        raise NotImplementedError

    def site_shapes(self) -> dict[str, tuple[int, int]]:
        return {
            f"{self.layer_prefix()}.{i}.{name}": shape
            for i in range(self.n_layers)
            for name, shape, _ in self.layer_sites()
        }

    def layer_site(self, path: str) -> tuple[int, str] | None:
        """(layer, name within the layer) of a site path, None for a path outside the blocks."""
        prefix = self.layer_prefix() + "."
        if not path.startswith(prefix):
            return None
        layer, _, name = path[len(prefix) :].partition(".")
        return (int(layer), name) if layer.isdigit() else None

    def layer_of(self, path: str) -> int | None:
        where = self.layer_site(path)
        return None if where is None else where[0]

    def mlp_neuron_sides(self) -> dict[str, str]:
        return {
            f"{self.layer_prefix()}.{i}.{name}": self.NEURON_SIDES[name]
            for i in range(self.n_layers)
            for name, _, _ in self.layer_sites()
            if name in self.NEURON_SIDES
        }

    def _remat(self, fn: Callable) -> Callable:
        """`fn` (a block) rematerialised in the backward by the `remat` policy."""
        return arrays.remat(fn, self.remat)

    # Training interface: next-token cross-entropy on packed text.

    def make_batch(self, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
        raise TypeError(f"{self.kind} reads text batches from pdctl.science.data, not make_batch")

    def inputs(self, batch: Mapping[str, jax.Array]) -> jax.Array:
        return batch["tokens"][:, :-1]

    def loss(
        self, params: Params, batch: Mapping[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        tokens = batch["tokens"]
        logits_BxTxV = self.apply(params, tokens[:, :-1])
        labels_BxT = tokens[:, 1:]
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, labels_BxT))
        accuracy = jnp.mean((jnp.argmax(logits_BxTxV, axis=-1) == labels_BxT).astype(jnp.float32))
        return ce, {"ce": ce, "accuracy": accuracy}

    def n_tokens_per_example(self) -> int:
        return self.seq_len


def rope(x_BxTxNxH: jax.Array, inv_freq_H2: Any) -> jax.Array:
    """Rotary embedding of positions 0..T-1 in the rotate-half layout of Hugging Face Llama, in
    float32, at the float32 inverse frequencies `inv_freq_H2` (H/2 of them)."""
    T, H = x_BxTxNxH.shape[1], x_BxTxNxH.shape[3]
    angle_TxH2 = jnp.arange(T, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq_H2)[None]
    cos = jnp.cos(angle_TxH2)[None, :, None, :]
    sin = jnp.sin(angle_TxH2)[None, :, None, :]
    x32 = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = x32[..., : H // 2], x32[..., H // 2 :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BxTxNxH.dtype)
