"""Learning-rate schedulers: each sets the optimizer's learning rate once per ``step()``."""

from __future__ import annotations

from onnxtrain.ondevice.optimizer import Optimizer


class LinearLRScheduler:
    """Linear warmup from 0 to ``initial_lr`` over ``warmup_step_count`` steps, then linear decay to 0 at
    ``total_step_count`` (as ONNX Runtime Training and transformers' get_linear_schedule_with_warmup)."""

    def __init__(self, optimizer: Optimizer, warmup_step_count: int, total_step_count: int, initial_lr: float):
        if warmup_step_count < 0 or total_step_count < warmup_step_count:
            raise ValueError(f"need 0 <= warmup_step_count <= total_step_count, got {warmup_step_count}, "
                             f"{total_step_count}")
        self._optimizer = optimizer
        self._warmup = warmup_step_count
        self._total = total_step_count
        self._initial_lr = initial_lr
        self._step = 0
        optimizer.set_learning_rate(initial_lr * self._factor(0))

    def _factor(self, step: int) -> float:
        if step < self._warmup:
            return step / max(1, self._warmup)
        return max(0.0, (self._total - step) / max(1, self._total - self._warmup))

    def step(self) -> None:
        """Advance one step and set the optimizer's learning rate for it (linear warm-up, then linear decay)."""
        self._step += 1
        self._optimizer.set_learning_rate(self._initial_lr * self._factor(self._step))
