"""``RandContext``: record the RNG state before a forward pass, replay it for the recomputation.

GradCache runs every chunk twice (once without a graph, once with). Anything random in the model
(dropout, stochastic depth, noise) must draw the same numbers both times, or the cached gradient
belongs to a different function than the one back-propagated through.

Which generators: the CPU one, and the default generator of every device that either the inputs or
the model live on. The model's devices matter on their own: a model that receives CPU tensors and
moves them to its GPU itself draws its dropout masks from the GPU's generator, which the inputs
alone would not name. GradCache passes ``devices=module_devices(model)``.
"""

from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn


def _devices_of(tensors: Iterable[torch.Tensor], devices: Iterable[torch.device] = ()) -> List[torch.device]:
    """The distinct non-CPU devices among ``tensors`` and ``devices``, in first-seen order (the CPU
    RNG is always saved)."""
    seen: Dict[Tuple[str, Optional[int]], torch.device] = {}
    found = [t.device for t in tensors if isinstance(t, torch.Tensor)] + [torch.device(d) for d in devices]
    for dev in found:
        if dev.type == "cpu":
            continue
        if dev.index is None and dev.type == "cuda":
            dev = torch.device("cuda", torch.cuda.current_device())
        seen.setdefault((dev.type, dev.index), dev)
    return list(seen.values())


def module_devices(model: nn.Module) -> List[torch.device]:
    """The distinct devices of ``model``'s parameters and buffers (a wrapper's, e.g. DDP's, included)."""
    seen: Dict[Tuple[str, Optional[int]], torch.device] = {}
    for t in (*model.parameters(), *model.buffers()):
        seen.setdefault((t.device.type, t.device.index), t.device)
    return list(seen.values())


def _device_rng_module(dev: torch.device):
    """``torch.cuda`` (or ``torch.xpu``, ...) when it can get/set a per-device RNG state; else None."""
    module = getattr(torch, dev.type, None)
    if module is None or not hasattr(module, "get_rng_state") or not hasattr(module, "set_rng_state"):
        return None
    return module


def get_rng_states(devices: List[torch.device]) -> Tuple[torch.Tensor, List[Tuple[torch.device, torch.Tensor]]]:
    """(CPU state, [(device, state)]) for the CPU generator and each device's default generator."""
    states = []
    for dev in devices:
        module = _device_rng_module(dev)
        if module is not None:
            states.append((dev, module.get_rng_state(dev)))
    return torch.get_rng_state(), states


def set_rng_states(cpu_state: torch.Tensor, device_states: List[Tuple[torch.device, torch.Tensor]]) -> None:
    torch.set_rng_state(cpu_state)
    for dev, state in device_states:
        _device_rng_module(dev).set_rng_state(state, dev)


class RandContext:
    """Snapshot of the CPU RNG and of the RNG of every device that ``tensors`` or ``devices`` name.

    ``RandContext(*tensors, devices=module_devices(model))`` records the states now (luyug's
    ``RandContext(*tensors)`` still works and covers the inputs' devices only). ``with ctx:`` sets
    them back for the duration of the block and, on exit, restores whatever the states were on
    entry, so the replay does not disturb the random stream of the surrounding code. It may be
    entered again later (each entry replays the same snapshot) but not re-entered while active.

    CUDA devices are handled through ``torch.cuda.get_rng_state(device)``; any other device type
    whose ``torch.<type>`` module has ``get_rng_state``/``set_rng_state`` is handled the same way.
    """

    def __init__(self, *tensors: torch.Tensor, devices: Iterable[torch.device] = ()):
        self.devices = _devices_of(tensors, devices)
        self.cpu_state, self.device_states = get_rng_states(self.devices)
        self._outer = None

    def __enter__(self) -> "RandContext":
        if self._outer is not None:
            raise RuntimeError("RandContext is already active; it cannot be entered twice at once")
        self._outer = get_rng_states(self.devices)
        set_rng_states(self.cpu_state, self.device_states)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        outer, self._outer = self._outer, None
        set_rng_states(*outer)
