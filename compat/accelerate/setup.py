"""Build hook of the hasten ``accelerate`` distribution: refuse to build over the real Accelerate.

pip runs no code when it installs a wheel, so the only moment ``pip install ./compat/accelerate`` can look
at the environment it installs into is the build. The build runs under the target interpreter
(``sys.prefix`` is the target environment even in pip's isolated build environment), so the check reads the
target's site-packages and ``sys.path``. A wheel built elsewhere skips this check; ``import accelerate``
then refuses instead (``accelerate/__init__.py``).
"""

import os
import sys
import sysconfig
from importlib.metadata import PathDistribution, distributions

from setuptools import setup

MARKER = "+hasten"


def _real_accelerate() -> list[str]:
    """``version at location`` of each installed distribution named accelerate that is not hasten's."""
    folders = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *sys.path]
    found = []
    for dist in distributions(name="accelerate", path=[f for f in dict.fromkeys(folders) if f]):
        if isinstance(dist, PathDistribution) and MARKER not in dist.version:
            found.append(f"{dist.version} at {dist.locate_file('')}")
    return found


if os.environ.get("HASTEN_ACCELERATE_BUILD_ANYWHERE") != "1":  # building a wheel to copy elsewhere
    real = _real_accelerate()
    if real:
        sys.exit(
            "error: the real Accelerate is installed here (accelerate " + "; ".join(real) + "): hasten's "
            "accelerate distribution would replace it. HINT: `pip uninstall accelerate` first, then "
            "`pip install ./compat/accelerate`; or keep the real Accelerate and call "
            "hasten.install_as_accelerate() only where you want hasten. "
            "(HASTEN_ACCELERATE_BUILD_ANYWHERE=1 builds the wheel regardless, e.g. for another machine.)")

setup()
