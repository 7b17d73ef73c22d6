"""The shared-memory transport of a single-host job: ``transport`` (``ShmTransport``),
``collectives`` (``ShmCollectives``), the ``arena`` of control words and slots in a
``segment``, the waits on its words (``spin``, then ``futex``), and each collective's
compiled ``loops`` (called through their ``fronts``) beside their interpreted twin,
``stepwise``."""
