"""systemd notification protocol (Type=notify): READY=1, WATCHDOG=1, STOPPING=1."""

from __future__ import annotations

import os
import socket


class SystemdNotifier:
    def __init__(self) -> None:
        self.address = os.environ.get("NOTIFY_SOCKET", "")
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        own = not pid or pid == str(os.getpid())
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and own else 0.0

    def _send(self, message: str) -> bool:
        if not self.address:
            return False
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            try:
                s.sendto(message.encode(), addr)
                return True
            except OSError:
                return False

    def ready(self, status: str = "") -> bool:
        return self._send("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def watchdog(self) -> bool:
        return self._send("WATCHDOG=1")

    def stopping(self) -> bool:
        return self._send("STOPPING=1")
