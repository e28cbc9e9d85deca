"""Child processes report to their parent: the relay between them.

Its rooms, each with its guarantees: where a child reports (``_relay_address.py``), the child's
end that sends (``_relay_uplink.py``), the parent's end that listens (``_relay_listener.py``)
and what it takes from each child's connection (``_relay_connection.py``); the wire format, who
may speak and what a message may hold are ``_wire.py``'s. The guarantees below span both ends.

Guarantees
----------
- Open windows at the parent's close: a child announces a bus with its first message, or as
  soon as a Stat of it holds a sample. Before the parent's bus closes (``close()``, and so at
  exit), the parent asks each child that announced it for its open windows (``CLOSING``); a
  thread of the child, which reads the parent's messages as they come, closes that bus's
  Stats' windows, sends them and then says so (``SENT``). The parent waits for every answer
  (or the child's end) within half the close's timeout, and names in a warning the children
  that did not answer (what they send later is counted as dropped there). From then on the
  child counts what it logs on that bus as dropped and says why: the parent closed its bus,
  or is exiting; "the parent process is gone" only when it is.
- What a killed child loses: SIGTERM or SIGKILL loses its Stats' open windows and an event
  it was writing at that instant (the parent warns of a torn message), nothing it logged
  before. A child that ends normally (a ``Pool`` or DataLoader worker included) first sends
  its open windows, and so does one still alive when its parent closes its bus or exits
  (persistent DataLoader workers, a kept iterator's), before ``multiprocessing`` terminates it.
"""

from __future__ import annotations

from ._relay_address import ENVIRONMENT as ENVIRONMENT
from ._relay_address import parse_environment as parse_environment
from ._relay_listener import Listener as Listener
from ._relay_uplink import Uplink as Uplink
