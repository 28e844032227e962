"""The process-wide runtime: the process group's lifetime and what hangs on it.

:mod:`~hasten.runtime.process_group` owns the group from start to end; the hang watchdog
(:mod:`~hasten.runtime.watchdog`, a daemon thread), the debug-mode collective checks
(:mod:`~hasten.runtime.debug_checks`, a gloo sub-group) and graceful preemption
(:mod:`~hasten.runtime.preemption`, a signal handler and a watcher thread) start and stop with it.
Where a process sits (rank, world, cluster) is :mod:`hasten.environments`, pure detection.
"""
