"""Starting a job over sockets: where this process sits (``env``), sockets with deadlines
(``net``), the job's secret and handshake (``auth``), taking connections (``accept``), the
rendezvous ``store`` (``memstore`` for ranks that are threads), the ``rendezvous`` itself
and the full ``mesh`` of connections."""
