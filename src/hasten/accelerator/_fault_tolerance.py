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
        if len(self._optimizers) > 1:
            raise ConfigurationError("fault tolerance commits one optimizer step per quorum: prepare one optimizer "
                                     f"(got {len(self._optimizers)}).")
        given = collective_timeout()
        group = ReplicaGroup(self._fault_tolerance, self._replica_state, self._load_replica_state, self.device,
                             given.total_seconds() if given is not None else None)
        self._replica_group = group
        for optimizer in self._optimizers:
            optimizer._replica_group = group
        group.begin_step()
        return group

    def _replica_state(self) -> dict[str, Any]:
        from hasten.fault_tolerance.replica import rng_state

        return {"models": [self.unwrap_model(model).state_dict() for model in self._models],  # type: ignore[attr-defined]
                "optimizers": [optimizer.optimizer.state_dict() for optimizer in self._optimizers],
                "schedulers": [scheduler.state_dict() for scheduler in self._schedulers],
                "loaders": [loader.state_dict() for loader in self._dataloaders if hasattr(loader, "state_dict")],
                "rng": rng_state()}

    def _load_replica_state(self, state: dict[str, Any]) -> None:
        from hasten.fault_tolerance.replica import set_rng_state

        for model, saved in zip(self._models, state["models"]):
            self.unwrap_model(model).load_state_dict(saved)  # type: ignore[attr-defined]
        for optimizer, saved in zip(self._optimizers, state["optimizers"]):
            optimizer.optimizer.load_state_dict(saved)
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

        return ReplicaGroupLoader(data_loader, self._attach_replica_group, self.process_index,  # type: ignore[attr-defined]
                                  self.num_processes, self.device if placement else None,  # type: ignore[attr-defined]
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
