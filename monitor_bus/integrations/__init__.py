"""Bridges from other libraries' event systems into a monitor_bus bus.

- ``monitor_bus.integrations.torch.forward_torch_monitor``: every ``torch.monitor`` event
  (torchelastic's, torchx's, your own) re-logged into a bus. Imports torch only when called.
"""

from __future__ import annotations
