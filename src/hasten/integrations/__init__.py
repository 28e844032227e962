"""Glue between hasten and the systems that start training processes themselves (Ray Train).

Each integration lives in its own module and imports its system lazily, so ``import hasten`` never needs it.
"""
