"""Collectives over two levels (shared memory inside a node, the network between): the plan
of a rank's steps (``plan``) and the route that runs them (``run``)."""
