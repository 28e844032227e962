"""Per-step fault tolerance over replica groups, on torchft (``hasten launch --replica_groups N``).

:class:`FaultToleranceConfig` (no torch import) is the one setting; :mod:`hasten.fault_tolerance.replica`
(torchft's Manager, imported only when fault tolerance is on), :mod:`hasten.fault_tolerance.data` (the global
cursor) and :mod:`hasten.fault_tolerance.lighthouse` (the Lighthouse process) do the work. See
docs/fault-tolerance.md.
"""

from hasten.fault_tolerance.timeouts import FaultToleranceConfig, Timeouts

__all__ = ["FaultToleranceConfig", "Timeouts"]
