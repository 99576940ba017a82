"""Who may open a data-plane connection to this worker, and what it shows its own peers.

When a worker registers, the controller draws it a key (DataKey) and gives it, with every
peer's data address, its ticket for that peer (Peers): ``messages.data_ticket`` of the
peer's key and this worker's id. A data connection opens with a hello that carries the
sender's id and ticket; the listener admits it only if the ticket is the one this worker's
key makes for that id. So only workers the controller admitted send each other transfer
copies: a client, whatever token it holds, cannot make one a session reads. The controller,
which draws every key, may connect too (as ``messages.CONTROLLER_SENDER``): its IFRT front
end puts its clients' arrays this way, each with the session's credential.

Peers may connect before this worker has its key (they learn of it as it registers, on
other connections), so a hello waits for the key a bounded time.

The listener's receive budget is shared by parties (``frame_parties``): each peer worker,
and each client session whose arrays the controller puts, may hold half of it at most.
"""

from __future__ import annotations

import hmac
import threading
from typing import Any, Hashable, Optional

from pathways.errors import ConnectError
from pathways.protocol.handles import MAX_HANDLE, session_of
from pathways.protocol.messages import CONTROLLER_SENDER, DataKey, Peers, data_ticket
from pathways.wire.handshake import Hello
from pathways.wire.security import HELLO_SECONDS

REFUSED = ("this worker takes data-plane connections only from the workers its controller admitted, each "
           "showing the ticket the controller gave it for this worker; clients put arrays with the Put method")


class PeerTickets:
    def __init__(self, key_wait: float = HELLO_SECONDS) -> None:
        self._key_wait = key_wait
        self._key: Optional[bytes] = None
        self._worker = -1  # this worker's id, with its key
        self._tickets: dict[str, bytes] = {}  # a peer's data address -> this worker's ticket there
        self.refused = 0  # hellos refused: from no admitted worker
        self._cond = threading.Condition()

    def learn(self, msg: DataKey | Peers) -> None:
        """Take this worker's key (DataKey), or peers' addresses and tickets (Peers)."""
        with self._cond:
            if type(msg) is DataKey:
                self._worker, self._key = msg.worker, msg.key
                self._cond.notify_all()
            else:
                self._tickets.update((address, ticket) for _, address, ticket in msg.peers)

    def ticket(self, address: str) -> tuple[int, bytes]:
        """What this worker shows the peer at ``address``: (its id, its ticket there);
        ConnectError if the controller gave it none."""
        with self._cond:
            ticket = self._tickets.get(address)
            if ticket is None or self._worker < 0:
                raise ConnectError(f"this worker has no ticket for the peer at {address}: the controller has not "
                                   "told it of that peer")
            return self._worker, ticket

    def admit(self, hello: Hello) -> Optional[str]:
        """None if ``hello`` carries a peer's id (or the controller's) and the ticket this
        worker's key makes for it, else the refusal to answer (waiting up to ``key_wait``
        seconds for the key)."""
        sender, shown = hello.sender, hello.ticket
        refusal: Optional[str] = REFUSED
        if sender is not None and sender >= CONTROLLER_SENDER and shown is not None:
            with self._cond:
                if not self._cond.wait_for(lambda: self._key is not None, self._key_wait):
                    refusal = REFUSED + " (this worker has not registered yet)"
                elif hmac.compare_digest(data_ticket(self._key, sender), shown):
                    return None
        with self._cond:
            self.refused += 1
        return refusal


def frame_parties(sender: Optional[int], header: Any) -> tuple[Hashable, ...]:
    """Whom a data frame's bytes are charged to on this worker's listener (tcp.Budget): a
    peer's frames to that worker; the controller's, which carry its IFRT clients' arrays,
    to the client session of the array, so that one session's trickled puts leave the
    rest of the budget to the other sessions and to the peers."""
    if sender is None:
        return ()
    if sender != CONTROLLER_SENDER:
        return (("worker", sender),)
    handle = header.get("handle") if type(header) is dict else None
    if type(handle) is int and 0 <= handle <= MAX_HANDLE:
        return (("session", session_of(handle)),)
    return (("controller", sender),)
