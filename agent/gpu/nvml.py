"""The real NVML: the one place that hands out pynvml itself as the agent's ``NvmlApi``.

Everything else talks to NVML through ``NvmlApi``, so the fake can stand in for it in tests and
with ``--gpu-backend fake:FILE``. Loading pynvml does not touch the driver: ``libnvidia-ml.so.1`` is
opened by ``nvmlInit``, whose failure (no driver, no library) ``NvmlSession`` remembers and reports.
"""

from __future__ import annotations

from typing import cast

import pynvml

from agent.gpu.api import NvmlApi


def load_nvml() -> NvmlApi:
    """The pynvml module, typed as the subset of it the agent uses."""
    return cast(NvmlApi, pynvml)
