"""Our collective algorithms: plans as data (``plans``), the engines that run them over a
``Call`` (``ring``, ``doubling``, ``tree``, ``direct``, ``monitored``), the table that picks
one by message size (``select``), and the hand-off to a transport's own collectives
(``native``)."""
