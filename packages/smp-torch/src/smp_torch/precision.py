"""Mixed precision: autocast contexts and a dynamic loss scaler for fp16.

Parameters and optimizer state stay fp32 (master weights); ``fp16``/``bf16`` run the step's
forward under ``torch.autocast``. With fp16 the loss is multiplied by a scale before backward;
the optimizer unscales, skips the update on every rank when any rank saw an inf/NaN, and
adapts the scale (halve on overflow, double after ``growth_interval`` clean steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from smp_torch.sharded import local_tensor

__all__ = ["autocast_context", "LossScaler"]


def autocast_context(fp16: bool, bf16: bool, device: torch.device) -> Any:
    """``torch.autocast`` for the configured precision, or a no-op context."""
    if not (fp16 or bf16):
        return contextlib.nullcontext()
    dtype = torch.float16 if fp16 else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


class LossScaler:
    """Dynamic loss scaling (the same decision on every rank of the job)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        dynamic: bool = True,
    ) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.dynamic = dynamic
        self._clean_steps = 0

    def unscale_and_check(
        self,
        params: list[torch.Tensor],
        group: Any = None,
        wait: Callable[[Any], None] | None = None,
        device: torch.device | None = None,
    ) -> bool:
        """Divide gradients by the scale; return True when every rank's grads are finite.

        ``wait`` waits for the agreement's collective (default: ``work.wait()``). ``device``:
        the device ``group`` serves (``ctx.device``; an NCCL group takes no host tensor),
        where the overflow flag is made; default the first gradient's device. The flags are
        computed on the device; the one read of the agreed flag is the only device-to-host
        sync (skipping the update is a decision of the host, as in ``torch.amp.GradScaler``).
        """
        inv = 1.0 / self.scale
        # A sharded gradient (DTensor) is checked on this rank's shard; the all-reduce below
        # covers the others.
        grads = [
            local_tensor(p.grad)
            for p in params
            if p.grad is not None
        ]
        if device is None:
            device = grads[0].device if grads else torch.device("cpu")
        for g in grads:
            g.mul_(inv)
        if grads:
            finite = torch.stack([torch.isfinite(g).all().to(device) for g in grads]).all()
            found = finite.logical_not().to(torch.float32).reshape(1)
        else:
            found = torch.zeros(1, dtype=torch.float32, device=device)
        if dist.is_initialized():
            work = dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group, async_op=True)
            if wait is None:
                work.wait()
            else:
                wait(work)
        return bool(found.item() == 0)

    def update(self, finite: bool) -> None:
        if not self.dynamic:
            return
        if not finite:
            self.scale *= self.backoff_factor
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale = float(sd["scale"])
        self._clean_steps = int(sd.get("clean_steps", 0))
