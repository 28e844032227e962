"""Every sample exactly once under failures: the replica groups read one global sample order at one cursor.

torchft's own sampler gives each group a fixed shard, so the samples of a lost group (and of steps that did not
commit) are never seen. Here the cursor is torchft's ``batches_committed()`` (group-batches of committed steps,
counted over the participants, healed with the Manager's state): at each step, participant ``i`` of ``n`` reads
group-batch ``cursor + i`` of the epoch's order, and the process of group rank ``r`` its ``r``-th slice. A step
that does not commit leaves the cursor where it was, so its samples are dealt again over whoever is in the next
quorum; a lost group's future samples go to the groups that remain. With gradient accumulation over ``k``
micro-batches, participant ``i`` reads group-batches ``k * i .. k * i + k - 1`` past ``k`` times the cursor.
The epoch ends, on every group at the same step, when the cursor passes the end of the order. On the epoch's last step, participants whose group-batch lies
past the end read the order's first samples again (as Accelerate's ``even_batches``) and
:attr:`ReplicaGroupLoader.padded` says so: those samples count twice in that one step.

Evaluation reads no cursor: a pass that starts with gradients off or every prepared model in eval mode iterates the
loader as Accelerate prepares it without replica groups, sharded over this group's own processes, so every group
evaluates the whole set, ``gather_for_metrics`` inside the group sees each sample once, and no quorum is joined
(another group's failure cannot stall it). An optimizer step during such a pass is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from hasten.exceptions import ConfigurationError
from hasten.ops.tree import send_to_device

if TYPE_CHECKING:
    from hasten.fault_tolerance.replica import ReplicaGroup

#: The order's seed when the loader has no generator of its own (the same in every group).
DEFAULT_SEED = 0


class ReplicaGroupLoader:
    """A data loader whose batches follow the replica groups' global cursor (see the module docstring).

    Args:
        loader: the user's ``DataLoader`` (map-style dataset; its ``batch_size`` is per process).
        replica_group: returns this process's :class:`ReplicaGroup` (built on first use).
        process_index: this process's rank in its group; ``num_processes``: the group's size.
        device: where batches go (None: left where the collate function put them).
        num_groups: the launch's replica groups (for ``len``).
        accumulation_steps: the current gradient accumulation steps (micro-batches per optimizer step).
        evaluation_loader: the same loader sharded over this group's processes only (Accelerate's usual prepared
            loader); iterated instead, whole, when ``evaluating()`` says so as an iteration starts.
        evaluating: whether an iteration starting now is an evaluation pass (no optimizer step between batches).
        optimizer_steps: the group's optimizer steps so far (an evaluation pass checks that none is taken).
    """

    def __init__(self, loader: DataLoader, replica_group: Any, process_index: int, num_processes: int,
                 device: torch.device | None, num_groups: int = 1,
                 accumulation_steps: Callable[[], int] = lambda: 1, evaluation_loader: Iterable[Any] | None = None,
                 evaluating: Callable[[], bool] = lambda: False,
                 optimizer_steps: Callable[[], int] = lambda: 0) -> None:
        if loader.batch_size is None or not hasattr(loader.dataset, "__len__"):
            raise ConfigurationError("fault tolerance reads batches at a global cursor: the DataLoader needs a "
                                     "map-style dataset (with __len__) and a batch_size (not a batch_sampler).")
        self.base_dataloader = loader
        self.dataset = loader.dataset
        self.batch_size = int(loader.batch_size)
        self.collate_fn = loader.collate_fn
        self.shuffle = isinstance(loader.sampler, RandomSampler)
        generator = getattr(loader, "generator", None)
        self.seed = int(generator.initial_seed()) if generator is not None else DEFAULT_SEED
        self._replica_group = replica_group
        self.process_index, self.num_processes = process_index, num_processes
        self.device = device
        self.num_groups, self.accumulation_steps = num_groups, accumulation_steps
        self.evaluation_loader, self.evaluating, self.optimizer_steps = evaluation_loader, evaluating, optimizer_steps
        #: the epoch being read and the cursor (group-batches committed) at its start; healed from peers
        self.epoch = 0
        self.epoch_start = 0
        #: whether the last batch held samples read again to fill the epoch's last step
        self.padded = False
        #: the dataset indices of the last batch
        self.last_indices: list[int] = []
        self._is_accelerate_prepared = True

    def __len__(self) -> int:
        """Batches of a whole epoch if every group took part (a failure makes an epoch longer); when evaluating,
        the batches of this process's shard of the whole set."""
        if self.evaluation_loader is not None and self.evaluating():
            return len(self.evaluation_loader)  # type: ignore[arg-type]
        per_step = self.batch_size * self.num_processes * max(1, self.num_groups)
        return -(-len(self.dataset) // per_step)  # type: ignore[arg-type]

    def _group(self) -> ReplicaGroup:
        return self._replica_group()  # type: ignore[no-any-return]

    def _order(self) -> torch.Tensor:
        size = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return torch.arange(size)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(size, generator=generator)

    def set_epoch(self, epoch: int) -> None:
        """Accepted for Accelerate compatibility; the epoch follows the cursor (it is healed with it)."""

    def state_dict(self) -> dict[str, int]:
        """The epoch, its starting cursor and the cursor now (sent to a healing peer; written by ``save_state``)."""
        return {"epoch": self.epoch, "epoch_start": self.epoch_start,
                "batches_committed": self._group().manager.batches_committed()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Load :meth:`state_dict`'s output, keeping its position within the epoch.

        When healing, torchft has already set the cursor to the peer's, so nothing moves. A checkpoint loaded
        later in the run, or in a new launch (whose cursor started again at 0), was saved at another cursor:
        the epoch's start moves by the difference, so that the next batch is the one after the saved step's.
        """
        shift = 0
        if "batches_committed" in state:
            shift = self._group().manager.batches_committed() - int(state["batches_committed"])
        self.epoch, self.epoch_start = int(state["epoch"]), int(state["epoch_start"]) + shift

    def __iter__(self) -> Iterator[Any]:
        """An evaluation pass when ``evaluating()`` (decided here, once per pass), else the training batches."""
        if self.evaluation_loader is not None and self.evaluating():
            return self._evaluation_batches(self.evaluation_loader)
        return self._training_batches()

    def _evaluation_batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The whole set over this group's processes: no quorum, nothing read from or sent to another group."""
        steps = self.optimizer_steps()
        self.padded, self.last_indices = False, []
        for batch in loader:
            yield batch
            if self.optimizer_steps() != steps:
                raise ConfigurationError(
                    "an optimizer step was taken during an evaluation pass over a loader prepared under fault "
                    "tolerance (the pass started with every prepared model in eval mode, or with gradients off): "
                    "such a pass reads the whole set on every replica group, so training on it would use each "
                    "sample once per group. HINT: call model.train() before iterating a training loader, "
                    "model.eval() before an evaluation one.")

    def _training_batches(self) -> Iterator[Any]:
        group = self._group()
        size = len(self.dataset)  # type: ignore[arg-type]
        block = self.batch_size * self.num_processes  # one group's samples per micro-batch
        order, epoch = self._order(), self.epoch
        micro, seen_votes = 0, -1
        while True:
            votes = group.steps_committed + group.steps_retried  # changes once per optimizer step
            micro = micro + 1 if votes == seen_votes else 0
            seen_votes = votes
            steps = max(1, int(self.accumulation_steps()))
            if micro >= steps:
                raise ConfigurationError(
                    f"a data loader prepared under fault tolerance follows the committed optimizer steps, but "
                    f"{micro + 1} batches were read without an optimizer.step() (gradient_accumulation_steps="
                    f"{steps}). HINT: step the prepared optimizer after every {steps} batch(es); to evaluate, call "
                    "model.eval() (or iterate under torch.no_grad()) before the loop.")
            # The local count first: after the epoch's last commit no quorum is joined (peers may have left).
            if micro == 0 and (group.manager.batches_committed() - self.epoch_start) * steps * block >= size:
                break
            committed, index, _participants = group.cursor()  # joins the step's quorum (and heals)
            if self.epoch != epoch:  # healed into another epoch
                order, epoch = self._order(), self.epoch
            consumed = (committed - self.epoch_start) * steps * block
            if micro == 0 and consumed >= size:
                break
            if index < 0:
                raise RuntimeError("this replica group is not taking part in the quorum (torchft spare); hasten's "
                                   "loader expects every live group to take part.")
            # Participant i reads micro-batches i*steps .. i*steps+steps-1 of the step's blocks.
            start = consumed + (index * steps + micro) * block + self.process_index * self.batch_size
            positions = [position % size for position in range(start, start + self.batch_size)]
            self.padded = start + self.batch_size > size
            self.last_indices = order[positions].tolist()
            batch = self.collate_fn([self.dataset[i] for i in self.last_indices])
            yield batch if self.device is None else send_to_device(batch, self.device)
        self.epoch += 1
        self.epoch_start = group.manager.batches_committed()


__all__ = ["ReplicaGroupLoader"]
