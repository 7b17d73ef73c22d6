"""The TCP transport: ``transport`` (``TcpTransport``: the start, each call's checks, the
abort notices, the barrier, close) over one ``link`` per peer, which owns that peer: its
``framing`` (the frames both ways, with the ``compiled`` system calls of small ones), its
``mailbox`` (the matching of messages to receives) and the waits. The links share a
``context``; ``records`` are a receive, a frame, a kept message, a send."""
