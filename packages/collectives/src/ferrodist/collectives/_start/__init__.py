"""Starting a job's groups: from ``init_process_group``'s arguments and the environment to a
transport (``backends``), and the two levels of a job that spans nodes (``levels``)."""
