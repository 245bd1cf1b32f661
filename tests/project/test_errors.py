"""Every error class of the package descends from one root, ``LmcError``, and keeps the
builtin base its callers catch; the client's waits raise errors of that root."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import lmc_server
from lmc_server.client import Client
from lmc_server.errors import LmcConnectionError, LmcError, LmcTimeoutError
from lmc_server.testing.process import free_port

#: Modules that need what a CPU-only install lacks (CuPy, torch, vLLM): not imported here.
OPTIONAL = ("cupy", "torch", "vllm", "mooncake", "matplotlib", "tqdm")


def package_error_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for mod in pkgutil.walk_packages(lmc_server.__path__, "lmc_server."):
        if mod.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(mod.name)
        except ImportError as e:
            if e.name and e.name.split(".")[0] in OPTIONAL:
                continue
            raise
        for name, obj in inspect.getmembers(module, inspect.isclass):
            if (
                issubclass(obj, BaseException)
                and obj.__module__ == mod.name
                and obj.__module__.startswith("lmc_server.")
            ):
                found[f"{obj.__module__}.{name}"] = obj
    return found


def test_every_error_class_descends_from_the_root() -> None:
    classes = package_error_classes()
    assert len(classes) >= 12, sorted(classes)  # the walk found them
    strays = [n for n, c in classes.items() if not issubclass(c, LmcError)]
    assert not strays, f"error classes outside LmcError: {strays}"


def test_the_builtin_bases_callers_catch_are_kept() -> None:
    from lmc_server.cache.geometry import GeometryError
    from lmc_server.declare import ConfigError
    from lmc_server.transfer.base import TransferError

    assert issubclass(ConfigError, ValueError) and issubclass(GeometryError, ValueError)
    assert issubclass(TransferError, RuntimeError)
    assert issubclass(LmcTimeoutError, TimeoutError)
    assert issubclass(LmcConnectionError, ConnectionError)


def test_one_except_catches_a_client_that_gets_no_answer() -> None:
    """No server on the port: the client's wait ends in an error of the root (and still a
    ``TimeoutError`` for callers that catch that)."""
    with pytest.raises(LmcError) as e, Client(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3):
        pass
    assert isinstance(e.value, TimeoutError)
