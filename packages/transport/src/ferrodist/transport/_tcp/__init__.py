"""The TCP transport: ``transport`` (``TcpTransport``: the start, the public calls, aborts,
close), ``link`` (one peer's connection: socket, framing, matching, waits), ``mailbox`` (the
matching of messages to receives), ``records`` (a receive, a frame, a kept message, a send)
and ``compiled`` (a small frame's system calls in compiled code)."""
