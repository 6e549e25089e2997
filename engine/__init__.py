"""The runtime: process groups, flat buffers, the comm thread/stream, checkpoints."""

from .batch.dealing import GlobalBatches
from .config import EngineConfig
from .core.loss import default_loss
from .core.rounds import NonFiniteGradientError
from .core.step_result import StepResult
from .engine import Engine
from .runtime.watchdog import WorkerLostError

__all__ = ["Engine", "EngineConfig", "GlobalBatches", "NonFiniteGradientError", "StepResult", "WorkerLostError",
           "default_loss"]
