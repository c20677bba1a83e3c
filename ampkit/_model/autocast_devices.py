"""Which device types have ``torch.autocast`` on, and for which arguments."""
import torch

DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "privateuseone")


def autocast_devices():
    """The device types whose autocast is on now."""
    active = []
    for device in DEVICE_TYPES:
        try:
            if torch.is_autocast_enabled(device):
                active.append(device)
        except (RuntimeError, ValueError):
            continue
    return active


def _device_of(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if torch.is_tensor(value):
            return value.device.type
        if isinstance(value, (list, tuple)):
            for v in value:
                if torch.is_tensor(v):
                    return v.device.type
    return None


def active_device(args, kwargs):
    """The device type whose autocast is on for these arguments, or None."""
    device = _device_of(args, kwargs)
    if device is None:
        active = autocast_devices()
        return active[0] if active else None
    try:
        return device if torch.is_autocast_enabled(device) else None
    except (RuntimeError, ValueError):
        return None
