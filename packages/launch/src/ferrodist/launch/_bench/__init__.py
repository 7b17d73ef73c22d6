"""``ferrodist bench``: the sweep over libraries, collectives and sizes (``sweep``), one rank
of its jobs (``worker``, started as ``python -m ferrodist.launch._bench.worker``), and its
tables, JSON and plot (``report``)."""
