"""``prepare_data_loader`` and ``skip_first_batches``: Accelerate's functions, with hasten's fixes.

How shuffling is kept identical on every process (the choice, and why):

* A shuffled loader gets its **own** ``torch.Generator``. Its seed is ``data_seed`` when given, else one
  number drawn from the global torch RNG **once, here at prepare time** (so ``set_seed(s)`` before
  ``prepare`` decides the order, as in Accelerate), and process 0's value is broadcast once so that all
  processes agree even without ``set_seed``. A generator the user supplied keeps its seed; its state is
  broadcast from process 0 once.
* After that, iterating never communicates: every process draws the same permutation from identical
  generators (Accelerate broadcasts the generator state before every epoch). torch's ``DataLoader`` draws a
  base seed from the global RNG at the start of every pass; the prepared loader draws its base seed from its
  own generator, and, when the user's loader had no generator, also consumes one number of the global RNG at
  the start of each pass, as Accelerate's prepared loader does, so that the user's random stream (dropout
  masks) is the same as under Accelerate. A pass that continues a restored position draws nothing (the
  uninterrupted run drew before the checkpoint's RNG snapshot), which exact resume needs.
* Unshuffled loaders draw nothing from the global RNG unless they use worker processes (whose seeds come
  from the loader's generator, seeded then from one global draw, so ``set_seed`` still governs them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from hasten.data.dispatch import DataLoaderDispatcher
from hasten.data.iterable import IterableDatasetShard
from hasten.data.loaders import DataLoaderShard, ResumableMixin, SkipDataLoader, _check_unsupported
from hasten.data.samplers import BatchSamplerShard, SeedableRandomSampler, SkipBatchSampler
from hasten.exceptions import ConfigurationError
from hasten.ops import broadcast, is_distributed
from hasten.state import PartialState

# DataLoader arguments carried over from the original loader (the rest is rebuilt by sharding).
_LOADER_KWARGS = {"num_workers": 0, "collate_fn": None, "pin_memory": False, "timeout": 0, "worker_init_fn": None,
                  "multiprocessing_context": None, "generator": None, "prefetch_factor": None,
                  "persistent_workers": False, "pin_memory_device": "", "in_order": True}


def _loader_kwargs(dataloader: DataLoader) -> dict[str, Any]:
    return {k: getattr(dataloader, k, default) for k, default in _LOADER_KWARGS.items()}


def _agreeing(num_processes: int) -> bool:
    return num_processes > 1 and is_distributed() and torch.distributed.get_world_size() == num_processes


def _agree_seed(seed: int, num_processes: int) -> int:
    if not _agreeing(num_processes):
        return seed
    value = torch.tensor([seed], dtype=torch.int64, device=PartialState().device)
    return int(broadcast(value, from_process=0).item())


def _agree_generator(generator: torch.Generator, num_processes: int) -> None:
    if _agreeing(num_processes):
        state = generator.get_state().to(PartialState().device)
        generator.set_state(broadcast(state, from_process=0).cpu())


def _new_generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def _global_draw() -> int:
    return int(torch.empty((), dtype=torch.int64).random_().item())


def _check_split(dataloader: DataLoader, num_processes: int) -> None:
    size = dataloader.batch_size
    if size is None:
        size = getattr(dataloader.batch_sampler, "batch_size", None)
        if size is None:
            raise ConfigurationError(
                "split_batches=True needs a batch size, but the loader's batch_size is None and its batch sampler "
                f"({type(dataloader.batch_sampler).__name__}) has no `batch_size`. HINT: use split_batches=False.")
    if size > 1 and size % num_processes != 0:
        raise ConfigurationError(
            f"To use a `DataLoader` in `split_batches` mode, the batch size ({size}) needs to be a round multiple of "
            f"the number of processes ({num_processes}). HINT: use a batch size divisible by {num_processes}, or "
            "split_batches=False (each process then reads whole batches).")


def _shuffle_setup(batch_sampler: Any, use_seedable: bool, data_seed: int | None, num_processes: int,
                   agree: bool) -> tuple[Any, torch.Generator | None]:
    """Give a random sampler an agreed generator (or make it seedable); returns (batch sampler, generator)."""
    sampler = getattr(batch_sampler, "sampler", None)
    if not isinstance(sampler, RandomSampler):
        return batch_sampler, None
    n = num_processes if agree else 1
    if use_seedable or isinstance(sampler, SeedableRandomSampler):
        seed = data_seed if data_seed is not None else getattr(sampler, "initial_seed", torch.initial_seed())
        new: RandomSampler = SeedableRandomSampler(sampler.data_source, replacement=sampler.replacement,
                                    num_samples=sampler._num_samples, generator=sampler.generator or torch.Generator(),
                                    data_seed=_agree_seed(int(seed), n))
    elif sampler.generator is None:
        seed = data_seed if data_seed is not None else _global_draw()
        new = RandomSampler(sampler.data_source, replacement=sampler.replacement, num_samples=sampler._num_samples,
                            generator=_new_generator(_agree_seed(seed, n)))
    else:
        _agree_generator(sampler.generator, n)
        return batch_sampler, sampler.generator
    if type(batch_sampler) is BatchSampler:  # rebuild rather than mutate the user's objects
        return BatchSampler(new, batch_sampler.batch_size, batch_sampler.drop_last), new.generator
    batch_sampler.sampler = new
    return batch_sampler, new.generator


def prepare_data_loader(dataloader: DataLoader, device: torch.device | None = None, num_processes: int | None = None,
                        process_index: int | None = None, split_batches: bool = False, put_on_device: bool = False,
                        rng_types: list[Any] | None = None, dispatch_batches: bool | None = None,
                        even_batches: bool = True, slice_fn_for_dispatch: Callable[..., Any] | None = None,
                        use_seedable_sampler: bool = False, data_seed: int | None = None, non_blocking: bool = False,
                        use_stateful_dataloader: bool = False, torch_device_mesh: Any = None) -> DataLoader:
    """Shard ``dataloader`` so this process reads only its batches; returns a new ``DataLoader``.

    Same arguments, defaults and index assignment as Accelerate's ``prepare_data_loader``. The result is a
    ``DataLoaderShard`` (or ``DataLoaderDispatcher`` with ``dispatch_batches``), a ``DataLoader`` subclass
    whose ``len()`` is this process's number of batches. Shuffling is identical on every process and
    never draws from the global RNG while iterating (module docstring); ``state_dict()`` /
    ``load_state_dict()`` resume a pass exactly.

    Args:
        dataloader: the loader to shard.
        device: where batches go with ``put_on_device`` (default: ``PartialState().device``).
        num_processes: number of processes (default: ``PartialState().num_processes``).
        process_index: this process's index (default: ``PartialState().process_index``).
        split_batches: split each batch across processes (the global batch stays ``batch_size``).
        put_on_device: move batches to ``device``.
        rng_types: generators to synchronise: ``"generator"`` (done once, here), ``"torch"``/``"cuda"``
            (at the start of every pass).
        dispatch_batches: process 0 reads and broadcasts (default: True for iterable datasets when
            ``put_on_device``, else False).
        even_batches: pad the end so every process gets the same number of batches.
        slice_fn_for_dispatch: how the dispatcher slices a batch.
        use_seedable_sampler: replace a ``RandomSampler`` by a ``SeedableRandomSampler`` (order = f(seed, epoch)).
        data_seed: seed of the shuffling generator (else drawn once from the global RNG).
        non_blocking: asynchronous device copies.
        use_stateful_dataloader: must be False (hasten loaders are resumable without torchdata).
        torch_device_mesh: a ``DeviceMesh``: a one-dimensional one is the data-parallel dimension; an N-D one
            (``accelerator.torch_device_mesh``) shards over its flattened ``"dp"`` view, so the ranks of one
            tensor/context-parallel group read the same batches.

    Example:
        >>> loader = prepare_data_loader(DataLoader(range(10), batch_size=2), num_processes=2, process_index=1)
        >>> [b.tolist() for b in loader]
        [[2, 3], [6, 7], [0, 1]]

    Raises:
        ConfigurationError: ``split_batches`` with a batch size not divisible by ``num_processes``;
            ``dispatch_batches=True`` without ``put_on_device``; ``use_stateful_dataloader=True``.
    """
    _check_unsupported(use_stateful_dataloader, None)
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ConfigurationError("dispatch_batches=True requires put_on_device=True (process 0 sends batches to "
                                 "the other processes' devices).")
    state = PartialState()
    if torch_device_mesh is not None:
        num_processes, process_index = _data_parallel_place(torch_device_mesh)
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    device = (device if device is not None else state.device) if put_on_device else None
    if split_batches:
        _check_split(dataloader, num_processes)
    dataset = dataloader.dataset
    kwargs = _loader_kwargs(dataloader)
    if isinstance(dataset, IterableDataset):
        return _prepare_iterable(dataloader, kwargs, device, num_processes, process_index, split_batches, rng_types,
                                 dispatch_batches, slice_fn_for_dispatch, non_blocking)
    sampler_is_batch_sampler = isinstance(dataloader.sampler, BatchSampler)
    batch_sampler = dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler
    batch_sampler, shuffle_gen = _shuffle_setup(batch_sampler, use_seedable_sampler, data_seed, num_processes,
                                                agree=not dispatch_batches)
    own_generator = kwargs["generator"] is not None
    pending = getattr(dataloader, "_pending_skip", 0) if isinstance(dataloader, SkipDataLoader) else 0
    if pending:  # skip_first_batches(loader) then prepare(): Accelerate keeps the skip, before sharding
        batch_sampler = SkipBatchSampler(batch_sampler, skip_batches=pending)
    kwargs["generator"] = _loader_generator(kwargs, shuffle_gen)
    if num_processes != 1 and not dispatch_batches:
        batch_sampler = BatchSamplerShard(batch_sampler, num_processes=num_processes, process_index=process_index,
                                          split_batches=split_batches, even_batches=even_batches)
    if dispatch_batches:
        return DataLoaderDispatcher(dataset, split_batches=split_batches, batch_sampler=batch_sampler,
                                    _drop_last=dataloader.drop_last, _non_blocking=non_blocking,
                                    slice_fn=slice_fn_for_dispatch, **kwargs)
    placement = {"sampler": batch_sampler, "batch_size": dataloader.batch_size} if sampler_is_batch_sampler \
        else {"batch_sampler": batch_sampler}
    prepared = DataLoaderShard(dataset, device=device, rng_types=_rng_types(rng_types, shuffle_gen),
                               synchronized_generator=shuffle_gen, _drop_last=dataloader.drop_last,
                               _non_blocking=non_blocking, **placement, **kwargs)
    prepared._generator_agreed = True
    prepared._global_base_seed = not own_generator
    return prepared


def _loader_generator(kwargs: dict[str, Any], shuffle_gen: torch.Generator | None) -> torch.Generator:
    """The generator torch's DataLoader draws each pass's base seed from (never the global one)."""
    if kwargs["generator"] is not None:
        return kwargs["generator"]
    if shuffle_gen is not None:
        return shuffle_gen
    # Worker seeds derive from it: with workers, let set_seed govern them; without, it is never used.
    return _new_generator(_global_draw() if kwargs["num_workers"] > 0 else 0)


def _rng_types(rng_types: list[Any] | None, generator: torch.Generator | None) -> list[str] | None:
    if rng_types is None:
        return None
    types = [str(getattr(t, "value", t)) for t in rng_types]
    return [t for t in types if t != "generator" or generator is not None]


def _prepare_iterable(dataloader: DataLoader, kwargs: dict[str, Any], device: torch.device | None,
                      num_processes: int, process_index: int, split_batches: bool, rng_types: list[Any] | None,
                      dispatch: bool, slice_fn: Callable[..., Any] | None, non_blocking: bool) -> DataLoader:
    dataset = dataloader.dataset
    generator = getattr(dataset, "generator", None)
    generator = generator if isinstance(generator, torch.Generator) else None
    if generator is not None and not dispatch:
        _agree_generator(generator, num_processes)
    own_generator = kwargs["generator"] is not None
    kwargs["generator"] = _loader_generator(kwargs, generator)
    kwargs["drop_last"] = dataloader.drop_last
    size = dataloader.batch_size
    if num_processes != 1 and not dispatch:
        if _has_native_shards(dataset, num_processes) and not split_batches:
            dataset = dataset.shard(num_shards=num_processes, index=process_index)  # type: ignore[attr-defined]
        else:
            dataset = IterableDatasetShard(dataset, batch_size=size if size is not None else 1,
                                           drop_last=dataloader.drop_last, num_processes=num_processes,
                                           process_index=process_index, split_batches=split_batches)
        if split_batches and size is not None:
            size = size // num_processes
    kwargs["batch_size"] = size
    if dispatch:
        return DataLoaderDispatcher(dataset, split_batches=split_batches, _drop_last=dataloader.drop_last,
                                    _non_blocking=non_blocking, slice_fn=slice_fn, **kwargs)
    prepared = DataLoaderShard(dataset, device=device, rng_types=_rng_types(rng_types, generator),
                               synchronized_generator=generator, _drop_last=dataloader.drop_last,
                               _non_blocking=non_blocking, **kwargs)
    prepared._generator_agreed = True
    if num_processes != 1 and not isinstance(dataset, IterableDatasetShard):
        prepared._native_shards = num_processes  # file shards: a position does not map onto another count
    prepared._global_base_seed = not own_generator
    return prepared


def _has_native_shards(dataset: Any, num_processes: int) -> bool:
    """A 🤗 ``datasets.IterableDataset`` with enough file shards is sharded natively, as in Accelerate."""
    return (type(dataset).__module__.startswith("datasets") and hasattr(dataset, "shard")
            and getattr(dataset, "n_shards", 0) >= num_processes)


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A loader whose **next pass only** starts ``num_batches`` batches in (later passes are whole).

    For a prepared loader this positions that loader itself and returns it (it stays registered for
    checkpointing, keeps its epoch and shuffling state, and its ``state_dict`` counts the skipped
    batches). A plain ``DataLoader`` gets a :class:`SkipDataLoader` copy. Map-style datasets skip indices
    without loading data. Accelerate's version skips on every pass of a new, unregistered loader.
    The skip replaces (does not add to) a position restored by ``load_state_dict``; ``len()`` of a
    prepared loader stays the length of a whole pass.

    Example:
        >>> loader = skip_first_batches(DataLoader(list(range(16)), batch_size=4), num_batches=2)
        >>> [b.tolist() for b in loader]
        [[8, 9, 10, 11], [12, 13, 14, 15]]
    """
    if num_batches < 0:
        raise ConfigurationError(f"skip_first_batches(num_batches={num_batches}): use a number >= 0.")
    if isinstance(dataloader, ResumableMixin):
        dataloader._pending_skip = int(num_batches)
        dataloader._pending_offset = 0
        return dataloader
    kwargs = _loader_kwargs(dataloader)
    dataset = dataloader.dataset
    if isinstance(dataset, IterableDataset):
        kwargs.update(batch_size=dataloader.batch_size, drop_last=dataloader.drop_last)
    elif isinstance(dataloader.sampler, BatchSampler):
        kwargs.update(sampler=dataloader.sampler, batch_size=dataloader.batch_size)
    elif dataloader.batch_sampler is not None:
        kwargs["batch_sampler"] = dataloader.batch_sampler
    else:
        kwargs.update(sampler=dataloader.sampler, batch_size=None)
    return SkipDataLoader(dataset, skip_batches=num_batches, **kwargs)


def _data_parallel_place(mesh: Any) -> tuple[int, int]:
    """``(data-parallel size, this rank's index)`` on ``mesh``: itself if 1-D, else its ``"dp"`` view."""
    if mesh.ndim == 1:
        return mesh.size(), mesh.get_local_rank()
    try:
        dp = mesh["dp"]
    except (KeyError, RuntimeError, ValueError) as exc:
        raise ConfigurationError(f"prepare_data_loader(torch_device_mesh=<{mesh.ndim}-D mesh {mesh.mesh_dim_names}>): an "
                                 "N-D mesh needs a flattened 'dp' dimension (ParallelismConfig.build_device_mesh makes "
                                 "one) to know which ranks read different batches.") from exc
    return dp.size(), dp.get_local_rank()
