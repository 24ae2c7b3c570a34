"""Optimizers and learning-rate schedules from an `OptimConfig` (optax)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from pdctl.config import OptimConfig


def schedule(cfg: Any, steps: int) -> optax.Schedule:
    """The learning rate at each step, as the reference's `get_scheduled_value`: a linear warmup
    from 0 over the first `int(warmup_frac * steps)` steps, then constant, or a linear / cosine
    decay from `lr` that reaches `final_lr_frac * lr` exactly at the last step.

    `cfg` is anything with `lr`, `schedule`, `warmup_frac` and `final_lr_frac` (the optimizers'
    tables and `[train.ppgd]`)."""
    warmup = int(cfg.warmup_frac * steps)
    decay = steps - warmup
    # Python floats, not ints, enter the traced arithmetic: a legal step count past int32
    # (`steps = 2**40`) would not fit the int32 a Python int becomes there.
    warmup_f, span = float(warmup), float(max(decay - 1, 1))
    # a sweep may pass these as tracers (pdctl.sweep.hyper): keep those as they are
    peak, final = (v if isinstance(v, jax.Array) else float(v) for v in (cfg.lr, cfg.final_lr_frac))
    kind = cfg.schedule
    if kind not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown schedule {kind!r}")

    def lr(step: Any) -> jax.Array:
        s = jnp.asarray(step, jnp.float32)
        if kind == "constant" or decay <= 1:
            main = jnp.full_like(s, peak)
        else:
            progress = jnp.clip((s - warmup_f) / span, 0.0, 1.0)
            if kind == "linear":
                mult = final + (1 - final) * (1 - progress)
            else:
                mult = final + (1 - final) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
            main = peak * mult
        if warmup == 0:
            return main
        return jnp.where(s < warmup_f, peak * s / warmup_f, main)

    return lr


def adamw(cfg: OptimConfig, steps: int, trainable: Any = None) -> optax.GradientTransformation:
    """AdamW with the schedule and optional global-norm clipping; `trainable` (a bool pytree)
    freezes the False leaves entirely (no update, no weight decay). `moments_dtype` bfloat16
    stores the first moment in bfloat16 (optax's `mu_dtype`: the update still computes in
    float32); the second moment stays float32."""
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(
        optax.adamw(
            schedule(cfg, steps),
            b1=cfg.b1,
            b2=cfg.b2,
            weight_decay=cfg.weight_decay,
            mu_dtype=jnp.bfloat16 if cfg.moments_dtype == "bfloat16" else None,
        )
    )
    tx = optax.chain(*parts)
    if trainable is None:
        return tx
    labels = jax.tree.map(lambda t: "train" if t else "frozen", trainable)
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)
