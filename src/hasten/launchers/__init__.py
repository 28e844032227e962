"""Launchers: how processes are created (torchrun's elastic agent in-process, mpirun, SLURM tasks, a plain
subprocess, and fork-based ``notebook_launcher`` / ``debug_launcher``).

Nothing is imported here so that ``hasten launch`` pays only for the launcher it uses; import
``hasten.launchers.plan``, ``hasten.launchers.torchrun``, ... or ``hasten.launchers.notebook`` directly.
"""
