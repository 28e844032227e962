"""hasten's distributed test scripts, under the file names of Accelerate's ``accelerate.test_utils.scripts``.

Each runs with ``hasten launch [--num_processes N] $(python -c "import hasten.test_utils.scripts.test_script as m; print(m.__file__)")``;
``hasten test`` launches ``test_script.py``. Importing one runs nothing.
"""
