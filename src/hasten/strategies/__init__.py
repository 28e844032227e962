"""Strategies: how the model is replicated or sharded."""

from hasten.strategies.base import SingleDeviceStrategy, Strategy, unwrap_common
from hasten.strategies.ddp import DDPStrategy, HastenDDP

__all__ = ["DDPStrategy", "HastenDDP", "SingleDeviceStrategy", "Strategy", "unwrap_common"]
