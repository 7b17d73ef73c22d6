"""Collectives composed over a group's public ones, as torch layers them: picklable objects
(``objects``) and torch's single-tensor layouts (``tensors``)."""
