"""ferrodist.launch: the ``ferrodist`` command (``ferrodist run -n N script.py``)."""

from ._cli import main
from ._run import JobResult, run

__all__ = ["JobResult", "main", "run"]
