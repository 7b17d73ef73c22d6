"""``ferrodist doctor``: the probes of this machine (``probes`` in the doctor's process,
``children`` in child processes), the report that runs and judges them (``report``), and
that report as text (``text``)."""
