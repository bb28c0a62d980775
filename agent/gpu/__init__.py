"""GPU access for the agent: NVML (real or fake) behind one typed boundary.

``open_backend`` turns ``--gpu-backend`` into an ``NvmlSession`` shared by the NVML collector and
the XID event source. It does not initialize NVML: a node whose driver is broken still starts and
reports the failure (and its NICs) every cycle.
"""

from __future__ import annotations

from agent.clock import Clock
from agent.errors import ConfigError
from agent.gpu.session import NvmlSession

BACKENDS_HELP = "nvml, fake:FILE or none"


def open_backend(spec: str, clock: Clock) -> NvmlSession | None:
    """``nvml``: the real library; ``fake:PATH``: a ``FakeNvml`` from that JSON file; ``none``: no GPUs.

    Raises ``ConfigError`` for any other spec, and for a fake file that is missing or malformed.
    """
    kind, sep, arg = spec.strip().partition(":")
    if kind == "none" and not sep:
        return None
    if kind == "nvml" and not sep:
        from agent.gpu.nvml import load_nvml  # noqa: PLC0415 - pynvml only when it is asked for

        return NvmlSession(load_nvml(), clock, source="nvml")
    if kind == "fake" and sep:
        if not arg:
            raise ConfigError(
                "--gpu-backend fake:FILE needs a file (a JSON description, see agent/gpu/fake.py)"
            )
        from agent.gpu.fake import FakeNvml  # noqa: PLC0415

        return NvmlSession(FakeNvml.from_file(arg), clock, source=f"fake:{arg}")
    raise ConfigError(f"--gpu-backend {spec!r}: expected {BACKENDS_HELP}")
