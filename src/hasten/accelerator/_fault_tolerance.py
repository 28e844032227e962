"""``Accelerator(fault_tolerance=...)``: per-step fault tolerance over replica groups (torchft).

On when ``fault_tolerance`` is given or the process was started by ``hasten launch --replica_groups N``. The
replica group (torchft's Manager, :mod:`hasten.fault_tolerance.replica`) is built at the first ``prepare`` that
holds an optimizer, and joins its first quorum there, so that a restarted group heals before its first forward.
The prepared optimizers then step only when the quorum commits; prepared data loaders read at the global cursor
(:mod:`hasten.fault_tolerance.data`) when training, and this group's shard of the whole set when evaluating.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hasten.accelerator._base import AcceleratorBase
from hasten.exceptions import ConfigurationError

if TYPE_CHECKING:
    from hasten.fault_tolerance.replica import ReplicaGroup
    from hasten.fault_tolerance.timeouts import FaultToleranceConfig


def resolve_fault_tolerance(value: Any) -> FaultToleranceConfig | None:
    """The settings from ``Accelerator(fault_tolerance=...)`` (a config, True, or None: the launch's)."""
    from hasten.config.env import FAULT_TOLERANCE_VAR, replica_group_env
    from hasten.fault_tolerance.timeouts import FaultToleranceConfig

    if value is None or value is False:
        text = replica_group_env().get(FAULT_TOLERANCE_VAR) if value is None else None
        return FaultToleranceConfig.from_json(text) if text else None
    if value is True:
        return FaultToleranceConfig()
    if isinstance(value, FaultToleranceConfig):
        return value
    raise ConfigurationError(f"Accelerator(fault_tolerance={value!r}) must be a FaultToleranceConfig, True or None.")


def skips_checkpoint_writes(accelerator: Any) -> bool:
    """Whether this process's replica group leaves ``save_state`` (and ``save_model``) to another group.

    After a committed step every group holds the same state, and every group's main process is a main process:
    without this, every group would write (and clear the staging folder of) the same checkpoint folder. The group
    with participant rank 0 in the latest quorum (the lowest replica id among the live groups; the Lighthouse gives
    the same answer to every process of every group in that quorum) writes; the others skip the save, with no
    collective across groups. If the writing group dies, the next quorum names another one. Before the replica
    group is built (no optimizer prepared yet) group 0 writes.
    """
    if getattr(accelerator, "_fault_tolerance", None) is None:
        return False
    group = getattr(accelerator, "_replica_group", None)
    if group is None:
        from hasten.config.env import REPLICA_GROUP_VAR, replica_group_env

        return int(replica_group_env().get(REPLICA_GROUP_VAR, "0")) != 0
    return not group.writes_checkpoints()


def check_replica_layout(distributed_type: Any, parallelism_config: Any) -> None:
    """Refuse, at ``prepare``, a layout inside the replica groups that the cross-group step cannot serve.

    Works: DDP, FSDP2 and tensor parallel (any DTensor layout that is the same in every group), where each rank's
    local gradient shards are averaged with the same rank of the other groups.

    Raises:
        ConfigurationError: DeepSpeed (its engine reduces the gradients and steps the optimizer itself, so
            neither the cross-group average nor the commit vote can run between them), or pipeline parallel
            (its stages step and hold state apart from hasten's prepared model; not supported in this version).
    """
    if distributed_type == "DEEPSPEED":
        raise ConfigurationError("fault tolerance (replica groups) does not work with DeepSpeed: its engine reduces "
                                 "the gradients and steps the optimizer itself, so hasten cannot average them over "
                                 "the groups or hold the step for the quorum's commit. HINT: use FSDP2 "
                                 "(--use_fsdp) inside each replica group.")
    if parallelism_config is not None and getattr(parallelism_config, "pp_enabled", False):
        raise ConfigurationError(f"fault tolerance (replica groups) does not support pipeline parallel inside a group "
                                 f"(pp_size={parallelism_config.pp_size}) in this version. HINT: use FSDP2 or tensor "
                                 "parallel inside each replica group, or pp_size=1.")


class FaultToleranceMixin(AcceleratorBase):
    """The replica group of a fault-tolerant run, and the state a restarted group heals from."""

    _fault_tolerance: FaultToleranceConfig | None = None
    _replica_group: ReplicaGroup | None = None

    @property
    def replica_group(self) -> ReplicaGroup | None:
        """This process's replica group (torchft's Manager inside), or None without fault tolerance."""
        return self._replica_group

    def _attach_replica_group(self) -> ReplicaGroup:
        """Build the replica group once (its first quorum heals this group from a live peer if it is behind)."""
        if self._replica_group is not None:
            for optimizer in self._optimizers:  # prepared by a later prepare() call
                optimizer._replica_group = self._replica_group
            return self._replica_group
        from hasten.config.env import collective_timeout
        from hasten.fault_tolerance.replica import ReplicaGroup

        assert self._fault_tolerance is not None
        check_replica_layout(self.distributed_type, self.parallelism_config)  # type: ignore[attr-defined]
        if len(self._optimizers) > 1:
            raise ConfigurationError("fault tolerance commits one optimizer step per quorum: prepare one optimizer "
                                     f"(got {len(self._optimizers)}).")
        given = collective_timeout()
        group = ReplicaGroup(self._fault_tolerance, self._replica_state, self._load_replica_state, self.device,
                             given.total_seconds() if given is not None else None,
                             group_size=self.num_processes,  # type: ignore[attr-defined]
                             align_group=self._align_group_replicas)
        self._replica_group = group
        for optimizer in self._optimizers:
            optimizer._replica_group = group
        group.begin_step()
        return group

    def _align_group_replicas(self) -> None:
        """Make each tensor this group replicates its group rank 0's copy (a collective of the group).

        Called by the replica group after each quorum before the first commit (see ``ReplicaGroup.begin_step``).

        While no step has committed, torchft heals group rank ``r`` of every group but the ``r``-th from the
        quorum's ``r``-th group (its primary per rank, torchft 0.2.0 ``init_sync``), so when the groups start
        from different weights a group's ranks load different groups' state.
        Shards stay one consistent model over the groups, but a replicated tensor (DDP's parameters, the
        ``Replicate`` dimensions of a DTensor, e.g. a row-wise TP layer's bias) would differ between the group's
        ranks, and nothing would bring it back. Later heals copy from groups that all hold the same state.
        """
        from hasten.fault_tolerance.shards import align_replicated

        if self.num_processes > 1:  # type: ignore[attr-defined]
            modules = [self.unwrap_model(model) for model in self._models]  # type: ignore[attr-defined]
            align_replicated([tensor for module in modules for tensor in (*module.parameters(), *module.buffers())])

    def _average_replica_gradients(self) -> None:
        """Average the step's gradients over the replica groups now (before clipping), not at the optimizer step.

        Clipping then sees the gradient of the whole global batch, as in a run without replica groups; under
        FSDP2 the strategy's norm also spans every shard of the group. No-op without replica groups.
        """
        if self._replica_group is not None:
            self._replica_group.average_gradients(
                [p for optimizer in self._optimizers for group in optimizer.optimizer.param_groups for p in group["params"]])

    def _replica_state(self) -> dict[str, Any]:
        """The state a healing peer loads; sharded tensors (FSDP2, TP) as this rank's local shards."""
        from hasten.fault_tolerance.replica import rng_state
        from hasten.fault_tolerance.shards import to_local_state

        return {"models": [to_local_state(self.unwrap_model(model).state_dict())  # type: ignore[attr-defined]
                           for model in self._models],
                "optimizers": [to_local_state(optimizer.optimizer.state_dict()) for optimizer in self._optimizers],
                "schedulers": [scheduler.state_dict() for scheduler in self._schedulers],
                "loaders": [loader.state_dict() for loader in self._dataloaders if hasattr(loader, "state_dict")],
                "rng": rng_state()}

    def _load_replica_state(self, state: dict[str, Any]) -> None:
        from hasten.fault_tolerance.replica import set_rng_state
        from hasten.fault_tolerance.shards import model_state_from_local, optimizer_state_from_local

        for model, saved in zip(self._models, state["models"]):
            inner = self.unwrap_model(model)  # type: ignore[attr-defined]
            inner.load_state_dict(model_state_from_local(saved, inner.state_dict()))
        for optimizer, saved in zip(self._optimizers, state["optimizers"]):
            params = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
            optimizer.optimizer.load_state_dict(optimizer_state_from_local(saved, params))
        for scheduler, saved in zip(self._schedulers, state["schedulers"]):
            scheduler.load_state_dict(saved)
        loaders = [loader for loader in self._dataloaders if hasattr(loader, "state_dict")]
        for loader, saved in zip(loaders, state["loaders"]):
            loader.load_state_dict(saved)
        set_rng_state(state["rng"])
        if self._replica_group is not None:
            self._replica_group.healed += 1

    def _replica_group_loader(self, data_loader: Any, placement: bool, evaluation_loader: Any) -> Any:
        from hasten.config.env import NUM_REPLICA_GROUPS_VAR, replica_group_env
        from hasten.fault_tolerance.data import ReplicaGroupLoader

        # The group's data-parallel ranks read different samples; tensor/context-parallel ranks share theirs.
        num_shards, shard_index = self._data_parallel_position()
        return ReplicaGroupLoader(data_loader, self._attach_replica_group, shard_index, num_shards,
                                  self.device if placement else None,  # type: ignore[attr-defined]
                                  num_groups=int(replica_group_env().get(NUM_REPLICA_GROUPS_VAR, "1")),
                                  accumulation_steps=lambda: self.gradient_accumulation_steps,
                                  evaluation_loader=evaluation_loader, evaluating=self._evaluating,
                                  optimizer_steps=self._optimizer_steps_voted)

    def _evaluating(self) -> bool:
        """Whether a prepared loader iterated now is an evaluation pass (docs/fault-tolerance.md, Evaluation).

        True when gradients are off (``torch.no_grad()``/``inference_mode()``) or every prepared model is in eval
        mode (``model.eval()``): as in Accelerate's examples and the Trainer's evaluation loop.
        """
        import torch

        if not torch.is_grad_enabled():
            return True
        return bool(self._models) and not any(model.training for model in self._models)

    def _optimizer_steps_voted(self) -> int:
        """Optimizer steps this group voted on so far (committed or not); 0 before the replica group exists."""
        group = self._replica_group
        return 0 if group is None else group.steps_committed + group.steps_retried
