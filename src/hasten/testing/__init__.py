"""Test utilities shipped with hasten: the multi-rank harness and its pytest plugin."""

from hasten.testing.distributed import RankFailed, preload_deepspeed, run_on_ranks

__all__ = ["RankFailed", "preload_deepspeed", "run_on_ranks"]
