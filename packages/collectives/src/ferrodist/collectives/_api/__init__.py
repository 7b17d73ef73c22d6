"""The module-level API shaped like ``torch.distributed``: the default group
(``default_group``), the calls on it (``calls``), batched point to point (``batch``) and more
of torch's names (``torch_names``)."""
