"""The machine a benchmark ran on: GPU name, driver and clocks (nvidia-smi, else pynvml) and
the versions of everything that changes a figure.  `nq bench` writes both into its JSON so a
figure is never read apart from the conditions it was measured under."""
from __future__ import annotations

import platform
import subprocess

import numpy as np

_SMI_FIELDS = ("name", "driver_version", "pci.bus_id", "clocks.sm", "clocks.mem", "clocks.max.sm",
               "clocks.max.mem", "temperature.gpu", "power.draw")


def gpu_clocks() -> dict:
    """Name, driver and current SM/memory clocks (MHz) of the GPU numba uses: nvidia-smi, else
    pynvml, else {"error": why}.  Never fails."""
    bus = None
    try:
        from numba import cuda
        bus = int(cuda.get_current_device().PCI_BUS_ID)
    except Exception:  # noqa: BLE001 -- no bus id: take the first GPU listed
        bus = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=" + ",".join(_SMI_FIELDS),
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
        rows = [dict(zip(_SMI_FIELDS, (v.strip() for v in line.split(","))))
                for line in out.strip().splitlines() if line.strip()]
        pick = [r for r in rows if bus is not None and _bus(r["pci.bus_id"]) == bus] or rows[:1]
        return {"source": "nvidia-smi", **pick[0]} if pick else {"error": "nvidia-smi listed no GPU"}
    except Exception as e:  # noqa: BLE001
        smi_error = f"nvidia-smi: {e}"
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        return {"source": "pynvml", "name": name.decode() if isinstance(name, bytes) else name,
                "driver_version": str(pynvml.nvmlSystemGetDriverVersion()),
                "clocks.sm": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "clocks.mem": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{smi_error}; pynvml: {e}"}


def _bus(bus_id: str):
    try:  # "00000000:19:00.0" -> 0x19
        return int(bus_id.split(":")[1], 16)
    except (IndexError, ValueError):
        return None


def versions() -> dict:
    from importlib import metadata

    import nq
    v = {"nq": nq.__version__, "python": platform.python_version(), "numpy": np.__version__}
    for dist in ("numba", "numba-cuda", "cuda-bindings", "torch"):
        try:
            v[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            v[dist] = None
    try:
        from cuda.bindings import driver as cu

        from nq.runtime.graphs import _check
        d = int(_check(cu.cuDriverGetVersion()))
        v["cuda_driver"] = f"{d // 1000}.{d % 1000 // 10}"
    except Exception as e:  # noqa: BLE001
        v["cuda_driver"], v["cuda_driver_error"] = None, str(e)[:200]
    return v
