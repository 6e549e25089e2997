"""The runtime: process groups, flat buffers, the comm thread/stream, checkpoints."""

from .config import EngineConfig
from .dealing import GlobalBatches
from .engine import Engine
from .step_result import StepResult
from .loss import default_loss
from .rounds import NonFiniteGradientError
from .watchdog import WorkerLostError

__all__ = ["Engine", "EngineConfig", "GlobalBatches", "NonFiniteGradientError", "StepResult", "WorkerLostError",
           "default_loss"]
