"""Optimizers and learning-rate schedules from an `OptimConfig` (optax)."""

from __future__ import annotations

from typing import Any

import jax
import optax

from pdctl.config import OptimConfig


def schedule(cfg: OptimConfig, steps: int) -> optax.Schedule:
    warmup = round(cfg.warmup_frac * steps)
    decay = max(steps - warmup, 1)
    end = cfg.lr * cfg.final_lr_frac
    if cfg.schedule == "constant":
        main = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "linear":
        main = optax.linear_schedule(cfg.lr, end, decay)
    else:
        main = optax.cosine_decay_schedule(cfg.lr, decay, alpha=cfg.final_lr_frac)
    if warmup == 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), main], [warmup])


def adamw(cfg: OptimConfig, steps: int, trainable: Any = None) -> optax.GradientTransformation:
    """AdamW with the schedule and optional global-norm clipping; `trainable` (a bool pytree)
    freezes the False leaves entirely (no update, no weight decay)."""
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(
        optax.adamw(schedule(cfg, steps), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    )
    tx = optax.chain(*parts)
    if trainable is None:
        return tx
    labels = jax.tree.map(lambda t: "train" if t else "frozen", trainable)
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)
