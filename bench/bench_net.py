"""Network helpers the bench scripts share."""
import socket


def free_port(host="127.0.0.1"):
    """A TCP port free on `host` now (the kernel's choice; a process that
    binds it a moment later may race another, as any such probe does)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
